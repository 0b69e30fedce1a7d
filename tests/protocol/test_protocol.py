"""boogu-protocol: the wire format between the trainer and the rollout worker (no vllm needed)."""

from __future__ import annotations

import shutil
from typing import ClassVar

import pytest
import torch

from boogu_protocol import (
    PROTOCOL_VERSION,
    GroupSpec,
    ProtocolError,
    RolloutSpec,
    bytes_tensor,
    lora_fingerprint,
    pack,
    tensor_bytes,
    unpack,
)


def spec(**changes) -> dict:
    base = RolloutSpec(
        groups=(GroupSpec("a red fox", negative="blurry"), GroupSpec("edit it", ref_image=0)),
        group_size=2,
        num_steps=4,
        guidance_scale=3.0,
        sampler="flow_sde",
        noise_level=0.7,
        window={"kind": "random", "size": 2, "window_range": [0, 3]},
        height=32,
        width=32,
        seed=5,
    ).to_json()
    base.update(changes)
    return base


def test_messages_round_trip_every_dtype_bitwise():
    tensors = {
        "f32": torch.randn(2, 3),
        "bf16": torch.randn(4).bfloat16(),
        "u8": torch.arange(7, dtype=torch.uint8),
        "i64": torch.tensor([-1, 5]),
        "strided": torch.randn(4, 4).t(),  # non-contiguous input is made contiguous
    }
    meta, back = unpack(pack({"spec": spec(), "x": [1, 2.5, None]}, tensors))
    assert meta == {"spec": spec(), "x": [1, 2.5, None]}
    assert set(back) == set(tensors)
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k


def test_bad_messages_say_what_is_wrong():
    with pytest.raises(ProtocolError, match="too short"):
        unpack(b"abc")
    with pytest.raises(ProtocolError, match="does not fit"):
        unpack((10**6).to_bytes(8, "little") + b"{}")
    with pytest.raises(ProtocolError, match="no 'boogu' metadata"):
        from safetensors.torch import save

        unpack(save({"x": torch.zeros(1)}))
    with pytest.raises(ProtocolError, match="not JSON-able"):
        pack({"x": float("nan")})
    with pytest.raises(ProtocolError, match="'x' is a list"):
        pack({}, {"x": [1]})


def test_reference_images_travel_as_bytes():
    data = b"\x89PNG\r\n\x1a\n" + bytes(range(256))
    assert tensor_bytes(bytes_tensor(data)) == data
    with pytest.raises(ProtocolError, match="1-D uint8"):
        tensor_bytes(torch.zeros(2, 2))


def test_rollout_spec_validates_each_field_by_name():
    parsed = RolloutSpec.from_json(spec())
    assert parsed.groups[1] == GroupSpec("edit it", "", 0) and parsed.protocol == PROTOCOL_VERSION
    assert RolloutSpec.from_json(parsed.to_json()) == parsed
    cases = {
        "protocol": (spec(protocol=PROTOCOL_VERSION + 1), "spec.protocol"),
        "unknown": (spec(temperature=1.0), r"unknown fields \['temperature'\]"),
        "groups": (spec(groups=[]), "spec.groups must be a non-empty list"),
        "group": (spec(groups=[{"negative": "x"}]), r"spec.groups\[0\]"),
        "group_size": (spec(group_size=0), "spec.group_size must be >= 1"),
        "guidance": (spec(guidance_scale=0.5), "spec.guidance_scale must be >= 1"),
        "bool": (spec(seed=True), "spec.seed must be an int"),
        "group key": (
            spec(groups=[{"instruction": "a", "image": 0}]),
            r"spec.groups\[0\] has unknown fields \['image'\]",
        ),
        "ref type": (spec(groups=[{"instruction": "a", "ref_image": "0"}]), r"spec.groups\[0\].ref_image"),
        "negative type": (spec(groups=[{"instruction": "a", "negative": 1}]), r"spec.groups\[0\].negative"),
        "window key": (spec(window={"kind": "random", "width": 2}), "spec.window must be an object"),
        "extra": (spec(extra={"eta": 1}), r"spec.extra is reserved"),
        "offset": (spec(group_offset=-1), "spec.group_offset must be an int >= 0"),
        "decode": (spec(decode="yes"), "spec.decode must be true or false"),
        "micro batch": (spec(micro_batch_size=-1), "spec.micro_batch_size must be an int >= 0"),
        "micro batch type": (spec(micro_batch_size=2.0), "spec.micro_batch_size must be an int >= 0"),
        "image guidance": (spec(image_guidance_scale=0.5), r"spec.image_guidance_scale must be >= 1"),
        "image guidance type": (spec(image_guidance_scale="2"), r"spec.image_guidance_scale must be >= 1"),
    }
    for data, message in cases.values():
        with pytest.raises(ProtocolError, match=message):
            RolloutSpec.from_json(data)
    assert RolloutSpec.from_json(spec(micro_batch_size=3)).micro_batch_size == 3
    old_spec = spec()
    del old_spec["micro_batch_size"]  # a trainer from before the field: the whole request at once
    assert RolloutSpec.from_json(old_spec).micro_batch_size == 0
    assert RolloutSpec.from_json(spec(image_guidance_scale=2.5)).image_guidance_scale == 2.5
    del old_spec["image_guidance_scale"]  # a trainer from before the field: no image guidance
    assert RolloutSpec.from_json(old_spec).image_guidance_scale == 1.0
    missing = spec()
    del missing["seed"]
    with pytest.raises(ProtocolError, match=r"lacks the fields \['seed'\]"):
        RolloutSpec.from_json(missing)


def test_lora_fingerprint_is_order_free_and_sees_every_change():
    state = {"a.lora_A.weight": torch.randn(4, 8), "a.lora_B.weight": torch.zeros(8, 4)}
    same = dict(reversed(list(state.items())))
    assert lora_fingerprint(state) == lora_fingerprint(same)
    changed = {**state, "a.lora_B.weight": state["a.lora_B.weight"].clone()}
    changed["a.lora_B.weight"][3, 1] = 1e-6
    assert lora_fingerprint(changed) != lora_fingerprint(state)
    renamed = {"b.lora_A.weight": state["a.lora_A.weight"], "b.lora_B.weight": state["a.lora_B.weight"]}
    assert lora_fingerprint(renamed) != lora_fingerprint(state)
    from boogu_adapters.lora import lora_fingerprint as trainer_side

    assert trainer_side is lora_fingerprint  # one algorithm on both sides of a sync


def test_lora_fingerprint_hashes_values_not_memory_layout():
    """Equal tensors fingerprint equal whatever their strides: a float sum reduced in another order
    (a transposed copy) differs in the last bits, which failed the sync check on equal weights."""
    torch.manual_seed(0)
    # LoRA shapes (rank 4 on a 3072-wide layer); the old float64 sums differed here by ~2e-12.
    a, b = torch.randn(4, 3072), torch.randn(3072, 4)
    for name, t in (("m.lora_A.weight", a), ("m.lora_B.weight", b)):
        transposed = t.t().contiguous().t()  # the same values, column-major
        assert not transposed.is_contiguous() and torch.equal(transposed, t)
        assert lora_fingerprint({name: transposed}) == lora_fingerprint({name: t}), name
    wide = torch.randn(64, 96)
    sliced = wide[:, ::2]  # a strided view
    assert not sliced.is_contiguous()
    assert lora_fingerprint({"k": sliced}) == lora_fingerprint({"k": sliced.clone()})
    bf16 = a.to(torch.bfloat16)
    assert lora_fingerprint({"k": bf16.t().contiguous().t()}) == lora_fingerprint({"k": bf16})


def test_lora_fingerprint_sees_name_dtype_shape_and_every_element():
    torch.manual_seed(0)
    a = torch.randn(4, 6)
    base = lora_fingerprint({"m.lora_A.weight": a})
    assert lora_fingerprint({"n.lora_A.weight": a}) != base
    assert lora_fingerprint({"m.lora_A.weight": a.reshape(6, 4)}) != base  # same bytes, other shape
    assert lora_fingerprint({"m.lora_A.weight": a.double()}) != base
    halves = torch.tensor([1.0, -2.0, 0.5])  # exactly representable: bfloat16 and float16 hold equal values
    assert lora_fingerprint({"k": halves.bfloat16()}) != lora_fingerprint({"k": halves.half()})
    for i in range(a.numel()):
        changed = a.clone()
        changed.view(-1)[i] = torch.nextafter(changed.view(-1)[i], torch.tensor(float("inf")))
        assert lora_fingerprint({"m.lora_A.weight": changed}) != base, f"element {i}: one ulp up"
    # Two values swapped keep every order-free sum; the bytes differ.
    swapped = a.clone()
    swapped[0, 0], swapped[0, 1] = a[0, 1], a[0, 0]
    assert lora_fingerprint({"m.lora_A.weight": swapped}) != base


class _DeviceLog(torch.Tensor):
    """A CPU tensor that records the ``.to`` calls made on it (a stand-in for a CUDA tensor, which a
    CPU-only run cannot make): the fingerprint must copy each tensor to the CPU, so a trainer's CUDA
    tensor and the worker's CPU copy hash the same bytes."""

    calls: ClassVar[list[tuple]] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.to:
            cls.calls.append((args[1:], dict(kwargs or {})))
        return super().__torch_function__(func, types, args, kwargs or {})


def test_lora_fingerprint_copies_each_tensor_to_the_cpu():
    torch.manual_seed(0)
    plain = {"m.lora_A.weight": torch.randn(3, 5), "m.lora_B.weight": torch.randn(5, 3)}
    logged = {k: v.clone().as_subclass(_DeviceLog) for k, v in plain.items()}
    _DeviceLog.calls.clear()
    assert lora_fingerprint(logged) == lora_fingerprint(plain)
    to_cpu = [call for call in _DeviceLog.calls if "cpu" in call[0] or call[1].get("device") == "cpu"]
    assert len(to_cpu) == len(plain), _DeviceLog.calls


@pytest.mark.gpu
def test_lora_fingerprint_is_the_same_on_cuda_and_cpu():
    if not torch.cuda.is_available():
        pytest.fail("marked gpu: needs a CUDA device")
    torch.manual_seed(0)
    state = {"m.lora_A.weight": torch.randn(64, 48), "m.lora_B.weight": torch.randn(48, 64).bfloat16()}
    on_cuda = {k: v.cuda().t().contiguous().t() for k, v in state.items()}
    assert lora_fingerprint(on_cuda) == lora_fingerprint(state)


def test_vllm_engine_config_is_checked_by_name():
    from boogu_trainer.config import ConfigError, load_config

    config = load_config(None, ["rollout.engine=vllm_omni", "rollout.vllm.url=http://a:1,http://b:2"])
    assert [config.rollout.vllm.url_for_rank(r, 2) for r in range(2)] == ["http://a:1", "http://b:2"]
    with pytest.raises(ConfigError, match=r"lists 2 worker\(s\) for 3 rank\(s\)"):
        config.rollout.vllm.url_for_rank(0, 3)  # a worker serves one trainer rank
    per_rank = load_config(None, ["rollout.vllm.devices=4,5;6,7"]).rollout.vllm
    assert [per_rank.devices_for_rank(r, 2) for r in range(2)] == ["4,5", "6,7"]
    with pytest.raises(ConfigError, match=r"2 device group\(s\) for 1 rank"):
        per_rank.devices_for_rank(0, 1)
    with pytest.raises(ConfigError, match=r"model\.edit_vlm_view='processor'"):
        load_config(None, ["rollout.engine=vllm_omni", "model.edit_vlm_view=processor"])
    with pytest.raises(ConfigError, match=r"rollout\.vllm\.url"):
        load_config(None, ["rollout.vllm.url=localhost:8765"])
    with pytest.raises(ConfigError, match=r"rollout\.engine"):
        load_config(None, ["rollout.engine=vllm"])
    with pytest.raises(ConfigError, match=r"rollout\.vllm\.request_timeout_s"):
        load_config(None, ["rollout.vllm.request_timeout_s=0"])


def test_checkpoint_identity_follows_the_bytes_not_the_path(tmp_path):
    from boogu_protocol import checkpoint_identity

    root = tmp_path / "a"
    (root / "transformer").mkdir(parents=True)
    (root / "scheduler").mkdir()
    (root / "transformer" / "config.json").write_text('{"hidden_size": 64}')
    (root / "scheduler" / "scheduler_config.json").write_text('{"shift": 3.0}')
    (root / "transformer" / "w.safetensors").write_bytes(bytes(range(256)) * 9000)
    copy = tmp_path / "b"
    shutil.copytree(root, copy)
    assert checkpoint_identity(root) == checkpoint_identity(copy)
    weights = bytearray((copy / "transformer" / "w.safetensors").read_bytes())
    weights[-5] ^= 1  # Base and Edit share a config: the weights' bytes must count
    (copy / "transformer" / "w.safetensors").write_bytes(bytes(weights))
    assert checkpoint_identity(root) != checkpoint_identity(copy)
