"""Record transformers' answers about the shipped configs in memlab/data/hf_resolved.json.

Run after a transformers upgrade (tests/test_hf_config_check.py says when it is stale):
    python tools/record_hf.py
The estimate then reads a shipped config without importing transformers (seconds saved);
under another transformers version the record is ignored and transformers is asked.
"""
from __future__ import annotations

import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from memlab.hf import config as hf  # noqa: E402
from memlab.hf import config_check as hf_config_check  # noqa: E402
from memlab.hf import read_run_configs as run_config  # noqa: E402
from memlab.hf import shape as hf_shape  # noqa: E402


def shipped_answers() -> None:
    """Every question the estimate asks transformers about each shipped config."""
    for name in hf.SHIPPED:
        hf_config_check.check_config(hf.load_config(name, checked=False))
        if hf.shipped_config(name)["model_type"] in hf_shape.FAMILIES:
            hf_shape.decoder_shape(name)
    run_config.read_training_args({})  # TrainingArguments' defaults (--training-args)


def main() -> int:
    table = hf_config_check.record(shipped_answers)
    out = ROOT / "memlab" / pathlib.Path(*hf_config_check.RECORDED)
    out.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    print(f"{out.relative_to(ROOT)}: {len(table['answers'])} answers, transformers {table['transformers']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
