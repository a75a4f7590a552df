"""``checkpointing`` and ``attention``: the model config's switches, chosen per step by StepConfig;
``StepConfig.model_config`` is the one place they meet."""
from dataclasses import replace

import pytest

from memlab.core.errors import InputError
from memlab.models.gpt_unet import GPTConfig, get_config
from memlab.step.training_step import StepConfig, build_trainer


def test_unset_on_the_step_the_model_configs_switches_are_built():
    cfg = get_config("tiny", checkpointing="full", attention="naive")
    step = StepConfig(model=cfg, seq=32, batch=2)
    assert (step.checkpointing, step.attention) == (None, None)  # nothing chosen on the step
    assert step.model is cfg  # kept as given: nothing moves
    assert (step.model_config.checkpointing, step.model_config.attention) == ("full", "naive")
    assert build_trainer(step).model.cfg == step.model_config  # what is built is what it says


def test_the_step_is_where_a_lesson_varies_them():
    step = StepConfig(model=get_config("tiny", checkpointing="full"), seq=32, batch=2)
    plain = replace(step, checkpointing="none")
    assert plain.model_config.checkpointing == "none"  # the step's choice wins over the model's
    assert replace(step, attention="naive").model_config.attention == "naive"
    model = build_trainer(replace(plain, checkpointing="selective")).model
    assert model.cfg.checkpointing == "selective"
    assert replace(plain, checkpointing=None).model_config.checkpointing == "full"  # the model's again


def test_a_preset_has_the_model_configs_defaults():
    defaults = GPTConfig.__dataclass_fields__
    assert (defaults["checkpointing"].default, defaults["attention"].default) == ("none", "sdpa")
    cfg = StepConfig().model_config
    assert (cfg.checkpointing, cfg.attention) == ("none", "sdpa")
    assert StepConfig().describe()["checkpointing"] == "none"  # describe writes what is built


def test_a_unet_has_no_attention_switch():
    step = StepConfig(model="unet-small", seq=16, batch=2, checkpointing="full")
    assert (step.checkpointing, step.attention) == ("full", None)
    assert step.model_config.checkpointing == "full" and not hasattr(step.model_config, "attention")
    with pytest.raises(InputError, match="attention='naive': the model 'unet-small' has no attention switch"):
        StepConfig(model="unet-small", seq=16, batch=2, attention="naive")


def test_a_bad_value_on_the_step_names_what_is_allowed():
    with pytest.raises(InputError, match="checkpointing='some'; allowed: none, full, selective"):
        StepConfig(checkpointing="some")
