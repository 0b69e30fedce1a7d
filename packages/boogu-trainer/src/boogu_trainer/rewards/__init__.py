"""Rewards for FlowGRPO: images and prompt records in, one float32 score per image out.

* `RewardFn`: the protocol, ``reward(images (B, 3, H, W) uint8, records) -> (B,) float32``,
  with a ``name``.
* Registry: `register_reward`, `build_reward`, `available_rewards`; a user's own reward by import
  path ``"package.module:function"`` (`load_user_reward` states the rule for classes/functions);
  `validate_reward_spec` checks a name and its option names without building the reward (the
  config calls it when it loads).
* Built-in rewards (each class/factory docstring gives what it measures, its range and cost):

  ==========================  ===================================================  =========
  ``ocr``                     reference OCR score, local RapidOCR (offline)        [0, 1]
  ``vlm_ocr``                 reference OCR score, VLM over OpenAI-compatible HTTP [0, 1]
  ``jpeg_compressibility``    minus JPEG size (q95) in kB                          (-inf, 0)
  ``jpeg_incompressibility``  JPEG size (q95) in kB                                (0, inf)
  ``clip_score``              CLIP-S: scale·max(cos(img, text), 0), local CLIPModel [0, scale]
  ``pickscore``               PickScore: logit_scale.exp()·cos(img, text)          about [-100, 100]
  ``aesthetic``               LAION aesthetic v2 MLP on normalised CLIP-L/14 emb.  roughly 1..10
  ``edit_preservation``       how much of the reference survives (CLIP image cos   [-1, 1] / [0, 1]
                              or 1 - mean|Δ|/255)
  ``http``                    any reward served over the reward-service protocol   the served reward's
                              (``boogu-reward-server``, docs/reward-service.md)
  ``demo_brightness``         mean brightness (demo only)                          [0, 1]
  ``demo_target_color``       closeness of the mean colour to a target (demo only) [0, 1]
  ``demo_contrast``           std of the pixel values over 127.5 (demo only)       [0, 1]
  ``demo_sky``                top-over-bottom brightness, 0.5 if equal (demo only) [0, 1]
  ``scene_exact``             GenEval-style: the image shows exactly what its       {0, 1}
                              procedural-scene caption names (boogu_data.scenes)
  ``scene_dense``             the fraction of the caption's clauses that hold       [0, 1]
  ``scene_graded``            GenEval's graded training reward (flow_grpo's         [-7, 1]
                              GenEval recipe): per named shape, count and colour
                              partial credit, plus the relation
  ``scene_edit_exact``        a scene edit done on the reference image's named      {0, 1}
                              object with every other object kept
                              (boogu_data.scene_edits)
  ``scene_edit_dense``        the fraction of the edit's clauses that hold          [0, 1]
  ==========================  ===================================================  =========

  ``ocr`` and ``vlm_ocr`` share `TranscriptionReward` (the scoring) and differ only in how they
  read the text.

* `WeightedRewards` / `build_rewards`: weighted sums from config-like specs, returning a
  `RewardOutput` with per-reward scores, the total and a per-sample ``finite`` mask (non-finite
  scores are reported, never replaced).
* `ocr_text_score`: the reference's OCR score formula on strings.
"""

# Importing the built-in reward modules (demo, http, jpeg, ocr, scene, scene_edit, vlm) registers their rewards.
from boogu_trainer.rewards import clip  # noqa: F401 (registers the CLIP-family rewards; loads transformers lazily)
from boogu_trainer.rewards.base import (
    OnError,
    RewardError,
    RewardFn,
    TranscriptionReward,
    check_batch,
    images_to_numpy,
)
from boogu_trainer.rewards.composite import RewardOutput, WeightedRewards, build_rewards
from boogu_trainer.rewards.demo import BrightnessReward, ContrastReward, SkyReward, TargetColorReward
from boogu_trainer.rewards.http import HttpReward
from boogu_trainer.rewards.jpeg import (
    JpegSizeReward,
    jpeg_compressibility,
    jpeg_incompressibility,
    jpeg_size_kb,
)
from boogu_trainer.rewards.ocr import OcrReward, ocr_engine
from boogu_trainer.rewards.registry import (
    CallableReward,
    available_rewards,
    build_reward,
    load_user_reward,
    register_reward,
    validate_reward_spec,
)
from boogu_trainer.rewards.scene import SceneReward, detect_objects, scene_dense, scene_exact, scene_graded
from boogu_trainer.rewards.scene_edit import SceneEditReward, scene_edit_dense, scene_edit_exact
from boogu_trainer.rewards.text_score import fold_text, levenshtein, ocr_text_score
from boogu_trainer.rewards.vlm import VlmOcrReward

__all__ = [
    "BrightnessReward",
    "CallableReward",
    "ContrastReward",
    "HttpReward",
    "JpegSizeReward",
    "OcrReward",
    "OnError",
    "RewardError",
    "RewardFn",
    "RewardOutput",
    "SceneEditReward",
    "SceneReward",
    "SkyReward",
    "TargetColorReward",
    "TranscriptionReward",
    "VlmOcrReward",
    "WeightedRewards",
    "available_rewards",
    "build_reward",
    "build_rewards",
    "check_batch",
    "detect_objects",
    "fold_text",
    "images_to_numpy",
    "jpeg_compressibility",
    "jpeg_incompressibility",
    "jpeg_size_kb",
    "levenshtein",
    "load_user_reward",
    "ocr_engine",
    "ocr_text_score",
    "register_reward",
    "scene_dense",
    "scene_edit_dense",
    "scene_edit_exact",
    "scene_exact",
    "scene_graded",
    "validate_reward_spec",
]
