"""Families composed by named operations (``with_images``, ``without_images``, ``with_host_values``)
and the registry (``register_family``, ``family_for``): each does what it says, values asserted."""
from dataclasses import replace
from types import SimpleNamespace

import pytest

from qgraph.families import FAMILIES, Family, UnsupportedModel, family_for, qwen3_5, qwen_moe, qwen_vision
from qgraph.families import register_family
from qgraph.families.qwen3_5 import QWEN3_5
from qgraph.families.qwen3_5_moe import QWEN3_5_MOE
from qgraph.families.qwen3_next import QWEN3_NEXT
from qgraph.families.qwen4_exp import QWEN4_EXP

VISION_HOSTS = set(qwen_vision.IMAGES.hosts)


def test_the_image_text_family_is_the_text_family_with_the_vision_part_last():
    assert QWEN3_5.images is qwen_vision.IMAGES
    assert QWEN3_5.values == (*qwen3_5.VALUES, *qwen_vision.VALUES)
    assert list(QWEN3_5.hosts) == [*qwen3_5.HOSTS, *qwen_vision.HOSTS]
    assert list(QWEN3_5.dims) == [*qwen3_5.DIMS, *qwen_vision.DIMS]
    assert QWEN3_5.vision_mixer == "self_attn"
    assert [b.path for b in QWEN3_5.repeated_blocks] == ["model.layers", "model.language_model.layers",
                                                         "model.visual.blocks"]
    assert QWEN3_5.repeated_blocks[-1].image_only
    assert {spec.host for spec in qwen_vision.VALUES} == VISION_HOSTS
    with pytest.raises(ValueError, match="already has images"):
        QWEN3_5.with_images(qwen_vision.IMAGES)


def test_without_images_leaves_exactly_the_text_part():
    text = QWEN3_5.without_images()
    assert text.values == qwen3_5.VALUES
    assert text.hosts == qwen3_5.HOSTS
    assert text.dims == qwen3_5.DIMS
    assert [b.path for b in text.repeated_blocks] == ["model.layers", "model.language_model.layers"]
    assert text.images is None and text.vision_mixer is None
    assert text.without_images() is text
    assert text.with_images(qwen_vision.IMAGES).values == QWEN3_5.values


def test_an_image_part_is_added_only_by_with_images():
    with pytest.raises(ValueError, match="with_images"):
        replace(QWEN3_5.without_images(), images=qwen_vision.IMAGES)


def test_the_moe_family_is_qwen3_5_with_the_moe_block_at_the_mlp():
    values = QWEN3_5.values
    first = next(i for i, spec in enumerate(values) if spec.host == "mlp")
    assert QWEN3_5_MOE.values == (*values[:first], *qwen_moe.VALUES,
                                  *(spec for spec in values[first:] if spec.host != "mlp"))
    assert [spec for spec in QWEN3_5_MOE.values if spec.host in {"mlp", "shared_expert"}] == list(qwen_moe.VALUES)
    assert QWEN3_5_MOE.values[-len(qwen_vision.VALUES):] == qwen_vision.VALUES  # the vision values stay last
    assert QWEN3_5_MOE.hosts == {**QWEN3_5.hosts, **qwen_moe.HOSTS}
    assert "intermediate_size" not in QWEN3_5_MOE.dims
    assert list(QWEN3_5_MOE.dims) == [*(name for name in QWEN3_5.dims if name != "intermediate_size"), *qwen_moe.DIMS]
    assert QWEN3_5_MOE.images is QWEN3_5.images and QWEN3_5_MOE.vision_mixer == QWEN3_5.vision_mixer
    assert QWEN3_5_MOE.export_patches is qwen_moe.patches
    assert QWEN3_5_MOE.forward_kwargs == qwen_moe.FORWARD_KWARGS
    assert QWEN3_5_MOE.kernels.module.endswith("qwen3_5_moe.modeling_qwen3_5_moe")
    assert QWEN3_5_MOE.kernels.functions == QWEN3_5.kernels.functions
    assert QWEN3_5_MOE.model_types == ("qwen3_5_moe_text",)


def test_with_host_values_refuses_what_is_not_there():
    with pytest.raises(ValueError, match="no values of host 'nowhere'"):
        QWEN3_5.with_host_values("nowhere", ())
    with pytest.raises(ValueError, match="no dims"):
        QWEN3_5.with_host_values("mlp", qwen_moe.VALUES, drop_dims=("no_such_dim",))


def test_qwen3_next_is_the_moe_family_without_images():
    assert QWEN3_NEXT.images is None and QWEN3_NEXT.vision_mixer is None
    assert not [spec for spec in QWEN3_NEXT.values if spec.host in VISION_HOSTS]
    assert not VISION_HOSTS & set(QWEN3_NEXT.hosts)
    assert not set(qwen_vision.DIMS) & set(QWEN3_NEXT.dims)
    assert QWEN3_NEXT.values == QWEN3_5_MOE.without_images().values
    assert QWEN3_NEXT.values == tuple(spec for spec in QWEN3_5_MOE.values if spec not in qwen_vision.VALUES)
    assert QWEN3_NEXT.position_rows == 1 and QWEN3_NEXT.check is not None
    assert [b.path for b in QWEN3_NEXT.repeated_blocks] == ["model.layers"]
    assert QWEN3_NEXT.kernels.module.endswith("qwen3_next.modeling_qwen3_next")


def test_families_are_registered_in_order():
    assert list(FAMILIES) == [QWEN3_5, QWEN3_5_MOE, QWEN3_NEXT, QWEN4_EXP]
    assert register_family(QWEN3_5) is QWEN3_5  # registering it again changes nothing
    assert list(FAMILIES) == [QWEN3_5, QWEN3_5_MOE, QWEN3_NEXT, QWEN4_EXP]


def _model(model_type):
    text = SimpleNamespace(model_type=model_type)
    config = SimpleNamespace(get_text_config=lambda: text)
    return SimpleNamespace(config=config, get_output_embeddings=lambda: object())


@pytest.fixture
def registry(monkeypatch):
    """The registry, restored after the test."""
    monkeypatch.setattr(FAMILIES, "_families", list(FAMILIES._families))
    return FAMILIES


def test_register_family_refuses_a_model_type_already_registered(registry):
    copy = replace(QWEN3_5_MOE, name="another_moe", model_types=("another", "qwen3_5_moe_text"))
    with pytest.raises(ValueError, match=r"'another_moe'.*'qwen3_5_moe_text'.*'qwen3_5_moe_text'"):
        register_family(copy)
    assert list(registry) == [QWEN3_5, QWEN3_5_MOE, QWEN3_NEXT, QWEN4_EXP]


def test_a_registered_family_is_picked_by_family_for(registry):
    with pytest.raises(UnsupportedModel, match="not a supported family"):
        family_for(_model("toy_text"))
    toy = replace(QWEN3_NEXT, name="toy", model_types=("toy_text",), classes="ToyForCausalLM", check=None)
    assert isinstance(toy, Family)
    assert register_family(toy) is toy
    assert list(registry)[-1] is toy
    assert family_for(_model("toy_text")) is toy
    assert family_for(_model("qwen3_next")) is QWEN3_NEXT


def test_the_registry_is_restored_after_a_test():
    assert [family.name for family in FAMILIES] == ["qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "qwen4_exp_text"]
