"""StepConfig owns ``checkpointing`` and ``attention``: one place to read and vary them."""
from dataclasses import replace

import pytest

from memlab.errors import InputError
from memlab.models import GPTConfig, get_config
from memlab.step import StepConfig, build_trainer


def test_a_model_configs_switches_move_into_the_step():
    step = StepConfig(model=get_config("tiny", checkpointing="full", attention="naive"), seq=32, batch=2)
    assert (step.checkpointing, step.attention) == ("full", "naive")
    # the step keeps the model at its defaults: the switches live in one place
    assert (step.model.checkpointing, step.model.attention) == ("none", "sdpa")
    assert (step.model_config.checkpointing, step.model_config.attention) == ("full", "naive")
    # ... so the same step written either way is the same step
    assert step == StepConfig(model=get_config("tiny"), seq=32, batch=2, checkpointing="full",
                              attention="naive")


def test_the_step_is_where_a_lesson_varies_them():
    step = StepConfig(model=get_config("tiny", checkpointing="full"), seq=32, batch=2)
    plain = replace(step, checkpointing="none")
    assert plain.model_config.checkpointing == "none"
    model = build_trainer(replace(plain, checkpointing="selective")).model
    assert model.cfg.checkpointing == "selective"  # what is built is what the step says


def test_unset_on_the_step_means_the_models_own_and_a_preset_has_the_defaults():
    assert (StepConfig().checkpointing, StepConfig().attention) == ("none", "sdpa")
    defaults = GPTConfig.__dataclass_fields__
    assert (defaults["checkpointing"].default, defaults["attention"].default) == ("none", "sdpa")


@pytest.mark.parametrize("name, on_model, on_step", [("checkpointing", "full", "selective"),
                                                      ("attention", "naive", "sdpa")])
def test_set_twice_with_different_values_is_refused(name, on_model, on_step):
    cfg = get_config("tiny", **{name: on_model})
    with pytest.raises(InputError, match=f"{name} is set twice: '{on_model}' on the model config "
                                         f"and '{on_step}' on the StepConfig; set it once, on the step"):
        StepConfig(model=cfg, **{name: on_step})
    assert getattr(StepConfig(model=cfg, **{name: on_model}), name) == on_model  # agreeing: fine


def test_a_unet_has_no_attention_switch():
    step = StepConfig(model="unet-small", seq=16, batch=2, checkpointing="full")
    assert (step.checkpointing, step.attention) == ("full", None)
    assert step.model_config.checkpointing == "full"
    with pytest.raises(InputError, match="attention='naive': the model 'unet-small' has no attention switch"):
        StepConfig(model="unet-small", seq=16, batch=2, attention="naive")


def test_a_bad_value_on_the_step_names_what_is_allowed():
    with pytest.raises(InputError, match="checkpointing='some'; allowed: none, full, selective"):
        StepConfig(checkpointing="some")
