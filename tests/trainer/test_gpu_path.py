"""The GPU path's contracts, checked on a CPU: the device each rank takes, generators and random ops
on one device, collectives on the rank's device, the same FSDP2 collectives on every rank, and the
fake-CUDA dry run of a whole training step (``boogu_dryrun``).

Each test here fails on the code before the fix it guards (docs/gpu-path.md lists which)."""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest
import torch

import boogu_dryrun as dryrun
from boogu_schedule import make_generator
from boogu_schedule.window import random_window
from boogu_trainer.distributed import DeviceError, DistEnv, resolve_device

REPO = Path(__file__).resolve().parents[2]


# ---- which device a rank takes -------------------------------------------------------------------


class FakeCuda:
    """``torch.cuda`` and ``torch.distributed`` calls recorded, for a machine with ``count`` GPUs."""

    def __init__(self, monkeypatch, count: int):
        self.calls: list[tuple] = []
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(
            torch.cuda, "set_device", lambda d: self.calls.append(("set_device", torch.device(d)))
        )
        import torch.distributed as dist

        monkeypatch.setattr(dist, "is_initialized", lambda: False)
        monkeypatch.setattr(
            dist, "init_process_group", lambda backend, **kw: self.calls.append(("init", backend, kw))
        )
        monkeypatch.setattr(dist, "get_rank", lambda: 0)
        monkeypatch.setattr(dist, "get_world_size", lambda: 4)


@pytest.mark.parametrize("local_rank", [0, 1, 3])
def test_each_rank_takes_its_local_gpu_before_the_process_group_starts(monkeypatch, local_rank):
    cuda = FakeCuda(monkeypatch, count=4)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    env = DistEnv.from_environment("auto", "auto", timeout_s=30)
    mine = torch.device("cuda", local_rank)
    assert env.device == mine
    assert cuda.calls[0] == ("set_device", mine), "the rank's GPU is current before NCCL starts"
    init = cuda.calls[1]
    assert init[0] == "init" and init[1] == "nccl"
    assert init[2]["device_id"] == mine
    assert init[2]["timeout"] == datetime.timedelta(seconds=30)


def test_device_resolution_refuses_what_cannot_work(monkeypatch):
    FakeCuda(monkeypatch, count=2)
    assert resolve_device("cuda", local_rank=1, world_size=2) == torch.device("cuda", 1)
    assert resolve_device("cuda:1", world_size=1) == torch.device("cuda", 1)
    with pytest.raises(DeviceError, match="names one GPU, but this job has 2 ranks"):
        resolve_device("cuda:0", local_rank=0, world_size=2)
    with pytest.raises(DeviceError, match="LOCAL_RANK=2 but this node shows 2 CUDA device"):
        resolve_device("cuda", local_rank=2, world_size=4)
    with pytest.raises(DeviceError, match=r"model\.device must be"):
        resolve_device("tpu", world_size=1)


def test_cuda_requested_without_cuda_is_an_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(DeviceError, match="CUDA is not available"):
        resolve_device("cuda")


# ---- generators and random ops on one device ----------------------------------------------------


def test_random_window_draws_on_its_generators_device():
    """The default window kind draws from the group's generator, which lives on the model's device:
    a CUDA generator refuses a CPU draw (the first rollout on a GPU used to fail here)."""
    with dryrun.fake_cuda() as session:
        generator = make_generator(7, device="cuda")
        assert isinstance(generator, dryrun.FakeCudaGenerator) and generator.device.type == "cuda"
        window = random_window(10, 2, (0, 5), 1.0, generator)
    assert 0 <= window.start <= 3
    assert session.errors == []


def test_random_op_check_refuses_a_draw_on_another_device():
    with dryrun.fake_cuda() as session:
        generator = make_generator(0, device="cuda")
        with pytest.raises(dryrun.DryRunError, match="draws a cpu tensor from a generator made for cuda"):
            torch.randint(0, 4, (1,), generator=generator)
        torch.randn(3, generator=generator, device=generator.device)  # the right way passes
    assert len(session.errors) == 1


# ---- collectives on the rank's device -------------------------------------------------------------


def test_collectives_move_host_tensors_to_the_ranks_device_and_a_cpu_tensor_in_nccl_is_caught():
    with dryrun.fake_cuda(world_size=2) as session:
        env = DistEnv(rank=0, world_size=2, device=torch.device("cuda", 0))
        gathered = env.all_gather_cat(torch.arange(3), "gather ids")
        total = env.all_reduce_sum(torch.ones(2), "sum counts")
        assert gathered.device.type == "cuda" and total.device.type == "cuda"
        assert gathered.shape == (6,)
        assert env.any(torch.tensor(False), "any bad") is False
        import torch.distributed as dist

        with pytest.raises(dryrun.DryRunError, match="got tensors on \\['cpu'\\]"):
            dist.all_reduce(torch.ones(2))  # what rollout.py's `group_id.cpu()` used to hand NCCL
    ops = [c.op for c in session.collectives]
    assert ops[:3] == ["c10d::allgather_", "c10d::allreduce_", "c10d::allreduce_"]
    assert all(d.startswith("cuda") for c in session.collectives[:3] for d in c.devices)


# ---- the same FSDP2 collectives on every rank -----------------------------------------------------


def _fsdp_collectives(with_reference: bool, pad_reference_stage: bool) -> list[tuple]:
    """(op, shapes, dtypes) of every collective of one FSDP2 forward+backward of the tiny transformer
    on fake CUDA, for a batch with or without a reference image."""
    from boogu_adapters.model import TINY_CONFIG, BooguImageTransformer2DModel
    from boogu_trainer.distributed import shard_transformer

    with dryrun.fake_cuda(world_size=2) as session:
        env = DistEnv(rank=0, world_size=2, device=torch.device("cuda", 0))
        with torch.device("cuda"), dryrun.cases._skip_initialisers():
            model = BooguImageTransformer2DModel(**TINY_CONFIG)
        model.requires_grad_(True)
        shard_transformer(model, env)
        model.pad_reference_stage = pad_reference_stage
        session.collectives.clear()
        c = TINY_CONFIG["in_channels"]
        width = TINY_CONFIG["instruction_feature_configs"]["instruction_feat_dim"]
        hidden = torch.randn(1, c, 8, 8, device="cuda")
        refs = [[torch.randn(c, 8, 8, device="cuda")]] if with_reference else None
        out = model(
            hidden,
            torch.full((1,), 0.5, device="cuda"),
            torch.randn(1, 6, width, device="cuda"),
            None,
            torch.ones(1, 6, dtype=torch.bool, device="cuda"),
            ref_image_hidden_states=refs,
        )
        out = out[0] if isinstance(out, (list, tuple)) else out
        out.float().sum().backward()
        return [(c.op, c.shapes, c.dtypes) for c in session.collectives]


def test_ranks_with_and_without_reference_images_issue_the_same_fsdp_collectives():
    """An edit row on one rank and a T2I row on another must run the same FSDP2 units: skipping the
    reference refiner's all-gathers on one rank hangs NCCL. Fails with pad_reference_stage off (what
    the transformer did before)."""
    edit = _fsdp_collectives(with_reference=True, pad_reference_stage=True)
    t2i = _fsdp_collectives(with_reference=False, pad_reference_stage=True)
    assert len(edit) > 0
    assert t2i == edit
    unpadded = _fsdp_collectives(with_reference=False, pad_reference_stage=False)
    assert unpadded != edit, "the check must see the difference the placeholder removes"


def test_reference_placeholder_changes_no_output():
    from boogu_adapters.model import TINY_CONFIG, BooguImageTransformer2DModel, randomize_parameters

    model = randomize_parameters(BooguImageTransformer2DModel(**TINY_CONFIG).eval(), 3, std=0.05)
    c = TINY_CONFIG["in_channels"]
    width = TINY_CONFIG["instruction_feature_configs"]["instruction_feat_dim"]
    g = torch.Generator().manual_seed(0)
    args = (
        torch.randn(2, c, 8, 8, generator=g),
        torch.tensor([0.3, 0.7]),
        torch.randn(2, 5, width, generator=g),
        None,
        torch.ones(2, 5, dtype=torch.bool),
    )
    plain = model(*args)
    model.pad_reference_stage = True
    padded = model(*args)
    torch.testing.assert_close(padded, plain, rtol=0, atol=0)


# ---- refusals -------------------------------------------------------------------------------------


def test_several_ranks_without_fsdp_are_refused(tmp_path):
    from boogu_trainer.config import ConfigError, load_config
    from boogu_trainer.trainer import Trainer

    config = load_config(None, [f"logging.run_dir={tmp_path}", "distributed.fsdp=false", "preflight=false"])
    env = DistEnv(rank=0, world_size=2, device=torch.device("cpu"))
    with pytest.raises(ConfigError, match=r"distributed\.fsdp=false on 2 ranks"):
        Trainer(config, dist=env)


# ---- the fake-CUDA dry run of a training step -----------------------------------------------------


def test_the_loops_functions_are_marked_and_a_read_under_one_is_in_a_loop():
    # A mark is made when its module is imported (the learners' losses when their class is defined).
    import boogu_adapters.recompute  # noqa: F401
    import boogu_trainer.learner  # noqa: F401
    from boogu_schedule.hot import per_iteration, per_iteration_functions

    marked = set(per_iteration_functions())
    assert {
        "boogu_schedule.sampling:sample_windowed",
        "boogu_adapters.step:boogu_velocity",
        "boogu_adapters.recompute:TransitionRecompute.step_stats",
        "boogu_trainer.learner:Learner._accumulate",
        "boogu_trainer.learner:Learner.optimizer_step",
        "boogu_trainer.learner:Learner._weights_finite",
        "boogu_trainer.algorithms.renoise:ForwardProcessAlgorithm.precompute_old",
        "boogu_trainer.algorithms.renoise:ForwardProcessAlgorithm.losses",
        "boogu_trainer.algorithms.flow_grpo:FlowGRPO.losses",
    } <= marked, marked

    def read():  # stands for the session's host_read, called from a tensor's .item()
        return dryrun.session._in_per_iteration()

    @per_iteration
    def loop_body():
        return read()

    def outside():
        return read()

    assert loop_body() and not outside()


@pytest.mark.slow
def test_dry_run_of_a_training_step_on_two_fake_gpus(tmp_path):
    """FlowGRPO, edit rows, two ranks (FSDP2 on the fake process group), mid-size model on fake CUDA
    in bf16: one rollout, one update, one evaluation call, with every device, generator and
    collective check on; the memory of each phase measured and planned."""
    from boogu_tiny.checkpoints import ensure_tiny_checkpoint

    tiny = ensure_tiny_checkpoint(tmp_path / "Boogu-Image")
    result = dryrun.run_case(
        "flow_grpo",
        True,
        preset=dryrun.presets()["mid"],
        repo=REPO,
        tiny_root=tiny,
        work=tmp_path / "run",
        world_size=2,
        eval_prompts_per_rank=2,
        overrides=["sampler.num_steps=6", "sampler.window_range=[0,3]"],
    )
    assert result.ok, result.traceback
    report = result.as_json()
    # The edit rows reached the rollout, not only the evaluation (run_case also refuses a mismatch).
    assert report["reference_images"]["rollout"] > 0 and report["reference_images"]["evaluation"] == 2
    assert report["host_reads_in_loops"] == 0, report["host_reads"]["in_loops"]
    assert set(report["host_reads"]["by_design"]) <= set(dryrun.BY_DESIGN)
    # The loop detection works: the optimizer step's two reads, made on purpose, are seen in the loop.
    assert {
        "boogu_trainer.learner:Learner.optimizer_step",
        "boogu_trainer.learner:Learner._weights_finite",
    } <= set(report["host_reads"]["by_design"])
    session = result.session
    phases = {c.phase for c in session.collectives}
    assert any(p.startswith("rollout") for p in phases) and any(p.startswith("update") for p in phases)
    assert "evaluation" in phases
    assert all(d.startswith("cuda") for c in session.collectives for d in c.devices)
    assert result.peaks["train"] > result.peaks["setup"] > 0
    assert result.plan["train"] > 0


def test_plan_flags_without_plan_and_an_infinite_request_timeout_are_refused(capsys):
    from boogu_trainer.cli import main
    from boogu_trainer.config import ConfigError, load_config

    assert main(["--gpu-memory", "80"]) == 2
    assert "only apply with --plan" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"rollout\.vllm\.request_timeout_s=inf"):
        load_config(None, ["rollout.vllm.request_timeout_s=.inf"])
