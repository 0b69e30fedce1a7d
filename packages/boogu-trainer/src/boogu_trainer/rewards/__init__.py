"""Rewards for FlowGRPO: images and prompt records in, one float32 score per image out.

* `RewardFn`: the protocol, ``reward(images (B, 3, H, W) uint8, records) -> (B,) float32``,
  with a ``name``.
* Registry: `register_reward`, `build_reward`, `available_rewards`; a user's own reward by import
  path ``"package.module:function"`` (`load_user_reward` states the rule for classes/functions).
* Built-in rewards (each class/factory docstring gives what it measures, its range and cost):

  ==========================  ===================================================  =========
  ``ocr``                     reference OCR score, local RapidOCR (offline)        [0, 1]
  ``vlm_ocr``                 reference OCR score, VLM over OpenAI-compatible HTTP [0, 1]
  ``jpeg_compressibility``    minus JPEG size (q95) in kB                          (-inf, 0)
  ``jpeg_incompressibility``  JPEG size (q95) in kB                                (0, inf)
  ``demo_brightness``         mean brightness (demo only)                          [0, 1]
  ``demo_target_color``       closeness of the mean colour to a target (demo only) [0, 1]
  ==========================  ===================================================  =========

* `WeightedRewards` / `build_rewards`: weighted sums from config-like specs, returning a
  `RewardOutput` with per-reward scores, the total and a per-sample ``finite`` mask (non-finite
  scores are reported, never replaced).
* `ocr_text_score`: the reference's OCR score formula on strings.
"""

# Importing the built-in reward modules (demo, jpeg, ocr, vlm) registers their rewards.
from boogu_trainer.rewards.base import OnError, RewardError, RewardFn, check_batch, images_to_numpy
from boogu_trainer.rewards.composite import RewardOutput, WeightedRewards, build_rewards
from boogu_trainer.rewards.demo import BrightnessReward, TargetColorReward
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
)
from boogu_trainer.rewards.text_score import fold_text, levenshtein, ocr_text_score
from boogu_trainer.rewards.vlm import VlmOcrReward

__all__ = [
    "BrightnessReward",
    "CallableReward",
    "JpegSizeReward",
    "OcrReward",
    "OnError",
    "RewardError",
    "RewardFn",
    "RewardOutput",
    "TargetColorReward",
    "VlmOcrReward",
    "WeightedRewards",
    "available_rewards",
    "build_reward",
    "build_rewards",
    "check_batch",
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
]
