"""Where a run's memory goes: the text encoder's placement (off the trainer's GPU with vllm-omni,
offloaded between encodes when the plan says it does not fit), the rotary cache and the one-step
pipeline's next batch in ``trainer --plan``, and the ranks' wait for their rollout workers."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from boogu_adapters.model import TINY_CONFIG, BooguImageTransformer2DModel, get_freqs_cis
from boogu_adapters.model.transformer import ROTARY_CACHE_SIZE
from boogu_trainer.config import demo_config
from boogu_trainer.plan import plan_memory, rotary_cache_bytes


def _config(tiny_checkpoint, model=None, rollout=None, **vllm):
    config = demo_config()
    m = dataclasses.replace(config.model, tiny_path=str(tiny_checkpoint), **(model or {}))
    r = dataclasses.replace(config.rollout, **(rollout or {}))
    return dataclasses.replace(config, model=m, rollout=r)


VLLM = {"engine": "vllm_omni"}


# ---- the rotary cache -----------------------------------------------------------------------------


@pytest.mark.parametrize("references", [0, 1])
def test_rotary_cache_bytes_match_what_the_model_keeps(references):
    """One cache entry, as `rotary_cache_bytes` counts it, is the bytes the model's LRU holds."""
    torch.manual_seed(0)
    model = BooguImageTransformer2DModel(**TINY_CONFIG).eval()
    rows, text, side = 3, 7, 8  # latents 8x8: a 4x4 token grid at patch 2
    latents = torch.randn(rows, 16, side, side)
    refs = [[torch.randn(16, side, side)] * references for _ in range(rows)] if references else None
    freqs = get_freqs_cis(TINY_CONFIG["axes_dim_rope"], TINY_CONFIG["axes_lens"], 10000)
    with torch.no_grad():
        model(
            latents, torch.zeros(rows), torch.randn(rows, text, 64), freqs, None, ref_image_hidden_states=refs
        )
    (entry,) = model._rotary_cache.values()
    held = sum(t.untyped_storage().nbytes() for t in entry[1].values() if t is not None)
    planned = rotary_cache_bytes(
        TINY_CONFIG,
        rows=rows,
        text_tokens=text,
        target_grid=(4, 4),
        reference_images=references,
        dtype=torch.float32,
    )
    assert planned == held


def test_plan_counts_the_rotary_cache(tiny_checkpoint):
    config = _config(tiny_checkpoint)
    plan = plan_memory(config, world_size=1, device_type="cuda")
    (key,) = [k for k in plan.static if k.startswith("rotary cache")]
    rows = max(plan.phases["rollout"].items * 2, plan.phases["train"].items * 2)  # batched CFG rows
    assert f"{ROTARY_CACHE_SIZE} layouts x {rows} rows" in key
    s = config.sampler
    one = rotary_cache_bytes(
        TINY_CONFIG, rows=rows, text_tokens=256, target_grid=(s.height // 16, s.width // 16)
    )
    assert plan.static[key] == ROTARY_CACHE_SIZE * one > 0


# ---- the one-step pipeline ------------------------------------------------------------------------


def test_plan_lists_the_pipelines_next_batch_in_host_memory(tiny_checkpoint):
    off = plan_memory(_config(tiny_checkpoint, rollout=VLLM), device_type="cuda")
    one = plan_memory(_config(tiny_checkpoint, rollout={**VLLM, "pipeline": "one_step"}), device_type="cuda")
    assert not off.host
    batch = [v for k, v in one.host.items() if k.startswith("one-step pipeline: next batch")]
    lora = [v for k, v in one.host.items() if k.startswith("one-step pipeline: LoRA")]
    assert batch and batch[0] > 0 and lora and lora[0] > 0
    assert "host memory" in one.render()
    assert one.static == off.static and one.peak == off.peak  # nothing of it on the GPU


def test_the_pipeline_keeps_the_next_batch_on_the_host_until_it_is_trained_on():
    from boogu_trainer.pipeline import RolloutPipeline
    from boogu_trainer.scoring import SampledBatch

    seen = []

    class Engine:
        on_host = False

        def trajectories_on_host(self):
            import contextlib

            @contextlib.contextmanager
            def ctx():
                Engine.on_host = True
                yield
                Engine.on_host = False

            return ctx()

    traj = _trajectory()

    class Scorer:
        engine = Engine()

        def sample(self, records, group_offset, step):
            seen.append(Engine.on_host)
            return SampledBatch(traj, records, None, group_offset, step, (0, 0, 0.0))

    class Data:
        def state_dict(self):
            return {"position": 0}

        def next_batch(self):
            return ["a", "b"]

    dist = SimpleNamespace(shard=lambda n: (0, n), device=torch.device("cpu"))
    pipe = RolloutPipeline(Scorer(), Data(), dist, torch.device("meta"))
    lora = {"w": torch.ones(3)}
    pipe.hold(0, lora)
    assert pipe.held[1]["w"].device.type == "cpu"
    assert pipe.held[1]["w"].untyped_storage().data_ptr() != lora["w"].untyped_storage().data_ptr()
    flight = pipe.submit(0)
    waited = pipe.wait(flight)
    assert seen == [True]  # the engine was asked to leave it on the host
    assert waited.trajectory.latents.device.type == "cpu"
    trained = pipe.wait(flight, on_device=True)
    t = trained.trajectory
    assert {x.device.type for x in (t.latents, t.mean, t.log_prob, t.conditioning.hidden_states)} == {"meta"}
    assert t.images.device.type == "cpu"  # scored on the host already
    assert flight.future.result()[0].trajectory.latents.device.type == "cpu"  # the kept copy stays there
    pipe.close()


def _trajectory():
    from boogu_adapters.types import Conditioning, Trajectory

    b, w = 2, 1
    return Trajectory(
        latents=torch.zeros(b, w + 1, 4, 2, 2),
        step_index=torch.zeros(b, w, dtype=torch.long),
        sigmas=torch.linspace(1, 0, 3),
        log_prob=torch.zeros(b, w),
        mean=torch.zeros(b, w, 4, 2, 2),
        std=torch.ones(b, w),
        window=((0, 1),) * b,
        group_id=torch.zeros(b, dtype=torch.long),
        conditioning=Conditioning(hidden_states=torch.zeros(b, 3, 8), attention_mask=torch.ones(b, 3)),
        final_latents=torch.zeros(b, 4, 2, 2),
        images=torch.zeros(b, 3, 16, 16, dtype=torch.uint8),
        nfe=4,
        sampler="flow_sde",
        noise_level=1.0,
        guidance_scale=1.0,
    )


# ---- the text encoder -----------------------------------------------------------------------------


def test_with_vllm_omni_the_trainer_holds_no_text_encoder(tiny_checkpoint):
    from boogu_adapters.components import QwenPromptEncoder
    from boogu_trainer.models import load_base_parts
    from boogu_trainer.plan import rank_text_encoder_placement

    local = _config(tiny_checkpoint)
    config = _config(tiny_checkpoint, rollout=VLLM)
    resident = plan_memory(local, device_type="cuda")
    plan = plan_memory(config, device_type="cuda")
    assert "text encoder weights" in resident.static and "text encoder" in resident.phases
    assert plan.text_encoder == "worker"
    assert not any("text encoder" in k for k in plan.static) and "text encoder" not in plan.phases
    assert plan.static_total < resident.static_total
    placement = rank_text_encoder_placement(config, torch.device("cpu"))
    assert placement == "worker"
    parts = load_base_parts(config, torch.device("cpu"), placement)
    assert {p.device.type for p in parts.text_encoder.parameters()} == {"meta"}  # nothing read or placed
    assert {p.device.type for p in parts.transformer.parameters()} == {"cpu"}
    encoder = QwenPromptEncoder(parts.text_encoder, parts.processor)
    with pytest.raises(RuntimeError, match=r"rollout\.engine=vllm_omni"):
        encoder(["a red cube"], None)


def test_the_plan_offloads_the_text_encoder_when_the_run_does_not_fit(tiny_checkpoint):
    config = _config(tiny_checkpoint)
    resident = plan_memory(config, device_type="cuda")
    weights = resident.static["text encoder weights"]
    # A GPU too small for the run with the encoder resident, large enough without it.
    gpu = (resident.peak - weights / 2) / 0.9 / 2**30
    tight = plan_memory(config, gpu_memory_gb=gpu, device_type="cuda")
    assert tight.text_encoder == "offloaded"
    assert "text encoder weights" not in tight.static
    assert tight.phases["text encoder"].fixed == resident.phases["text encoder"].fixed + weights
    assert tight.host["text encoder weights (offloaded)"] == weights
    assert tight.peak < resident.peak and tight.fits
    roomy = plan_memory(config, gpu_memory_gb=resident.peak * 2 / 2**30, device_type="cuda")
    assert roomy.text_encoder == "resident"
    never = _config(tiny_checkpoint, model={"text_encoder_offload": "never"})
    assert plan_memory(never, gpu_memory_gb=gpu, device_type="cuda").text_encoder == "resident"
    always = _config(tiny_checkpoint, model={"text_encoder_offload": "always"})
    assert plan_memory(always, device_type="cuda").text_encoder == "offloaded"


def test_an_offloaded_encoder_runs_on_its_device_and_waits_on_the_host(tiny_parts, monkeypatch):
    """Each encode moves the weights to ``offload_to`` and back; the host tensors (and so the prompt
    cache's keys) stay the same, and the features equal a resident encoder's."""
    from boogu_adapters import components
    from boogu_adapters.components import QwenPromptEncoder
    from boogu_adapters.encoding import _module_device

    prompts = ["a red cube", "two blue spheres"]
    resident = QwenPromptEncoder(tiny_parts.text_encoder, tiny_parts.processor, cache_entries=0)
    expected = resident(prompts, None)
    encoder = QwenPromptEncoder(tiny_parts.text_encoder, tiny_parts.processor, offload_to="cpu")
    pointers = [p.data_ptr() for p in tiny_parts.text_encoder.parameters()]
    got = encoder(prompts, None)
    torch.testing.assert_close(got[0], expected[0], rtol=0, atol=0)
    assert [p.data_ptr() for p in tiny_parts.text_encoder.parameters()] == pointers
    assert encoder(prompts, None)[0] is got[0]  # the cache key survived the round trip

    during = []

    def recording(text_encoder, *args, **kwargs):
        during.append([p.data_ptr() for p in text_encoder.parameters()])
        return SimpleNamespace(hidden_states=expected[0], attention_mask=expected[1])

    monkeypatch.setattr(components, "encode_prompts", recording)
    moved = QwenPromptEncoder(
        tiny_parts.text_encoder, tiny_parts.processor, offload_to="cpu", cache_entries=0
    )
    moved(prompts, None)
    # the encode ran on copies of the weights (on the offload device), the host ones came back after
    assert len(during) == 1 and not set(during[0]) & set(pointers)
    assert [p.data_ptr() for p in tiny_parts.text_encoder.parameters()] == pointers
    assert _module_device(tiny_parts.text_encoder).type == "cpu"


# ---- waiting for the rollout workers --------------------------------------------------------------


class _Group:
    """Stands in for ``torch.distributed``'s group calls: records them, answers for the other rank."""

    def __init__(self, monkeypatch, other_rank_error=None):
        import torch.distributed as dist

        self.timeouts, self.gathers = [], []
        self.other = other_rank_error
        monkeypatch.setattr(dist, "new_group", self.new_group)
        monkeypatch.setattr(dist, "all_gather_object", self.all_gather_object)

    def new_group(self, backend=None, timeout=None, **kwargs):
        self.timeouts.append((backend, timeout.total_seconds()))
        return "startup-group"

    def all_gather_object(self, out, obj, group=None):
        self.gathers.append((group, obj))
        out[0], out[1] = obj, self.other


def _env():
    from boogu_trainer.distributed import DistEnv

    return DistEnv(rank=0, world_size=2, timeout_s=600.0)


def test_ranks_wait_for_their_workers_on_a_group_that_outlasts_the_startup(monkeypatch):
    from boogu_trainer.distributed import startup_wait_s

    config = demo_config()
    startup, nccl = config.rollout.vllm.startup_timeout_s, config.distributed.timeout_s
    assert startup > nccl  # the defaults: a slow worker outlasts the NCCL timeout
    wait = startup_wait_s(startup, nccl)
    assert wait > startup
    group = _Group(monkeypatch)
    assert _env().start_on_every_rank(lambda: "engine", "start its rollout worker", wait) == "engine"
    assert group.timeouts == [("gloo", wait)]
    assert group.gathers == [("startup-group", None)]  # on that group, not the NCCL one


def test_a_worker_that_failed_on_another_rank_stops_this_one(monkeypatch):
    _Group(monkeypatch, other_rank_error="RolloutWorkerError: did not come up")
    closed = []
    engine = SimpleNamespace(close=lambda: closed.append(True))
    with pytest.raises(RuntimeError, match="rank 1 could not start its rollout worker: RolloutWorkerError"):
        _env().start_on_every_rank(lambda: engine, "start its rollout worker", 1020.0)
    assert closed == [True]


def test_a_rank_whose_worker_failed_tells_the_others_then_raises_its_error(monkeypatch):
    group = _Group(monkeypatch)

    def fail():
        raise ValueError("no such checkpoint")

    with pytest.raises(ValueError, match="no such checkpoint"):
        _env().start_on_every_rank(fail, "start its rollout worker", 1020.0)
    assert group.gathers == [("startup-group", "ValueError: no such checkpoint")]
