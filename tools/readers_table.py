"""Issue 38's table: every real run file and OOM message in tests/data, what its source says of
its own run, memlab's answer, and whether the two agree.

    python tools/readers_table.py            # both tables, as Markdown
    python tools/readers_table.py --configs  # the run files only
    python tools/readers_table.py --oom      # the OOM messages only

Each run file is answered by ``memlab estimate`` on the run its source describes (the model,
the cards, the launcher's files beside it: :data:`RUNS`). An answer agrees with its source when
the source's statement holds of it: the run fits the stated cards, or does not; a measured
peak is within the stated tolerance; a refusal is one line that names the field. A file whose
source states nothing about memory answers with a number (its reading is checked field by field
in tests/test_real_run_configs.py). ``tests/test_real_run_configs.py`` and ``tests/test_oom.py``
assert every row; this script prints them.
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import io
import json
import pathlib
import re
import sys
import tempfile
from dataclasses import dataclass

ROOT = pathlib.Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "run_configs"
OOM = ROOT / "tests" / "data" / "oom_messages"
GIB = 2**30

ZEPHYR = ["--hf-config", "mistral-7b", "--training-args", "alignment-handbook/config_full.yaml"]
QLORA = ["--hf-config", "mistral-7b", "--training-args", "alignment-handbook/config_qlora.yaml"]
QWEN3 = ["--hf-config", "models/qwen3-4b-instruct-2507.json", "--training-args"]
A100x8 = ["--world-size", "8", "--gpu", "A100-80GB"]
#: file: (the ``memlab estimate`` arguments, files named relative to tests/data/run_configs;
#: what the source's statement makes of the answer: ``fits``, ``no fit``, ``number`` (no
#: statement), ``refuse:TEXT`` (a one-line refusal naming TEXT), ``near:GIB:TOL`` (fits, within
#: TOL of the stated GiB), ``above:GIB`` (the peak exceeds GIB, a bound from the file's arithmetic))
RUNS: dict[str, tuple[list[str], str]] = {
    "alignment-handbook/config_full.yaml": (
        ZEPHYR + ["--accelerate-config", "alignment-handbook/zero3.yaml", "--gpu", "A100-80GB"], "fits"),
    "alignment-handbook/config_qlora.yaml": (QLORA + ["--gpu", "A100-80GB"], "fits"),
    "alignment-handbook/ddp.yaml": (QLORA + ["--accelerate-config", "alignment-handbook/ddp.yaml",
                                             "--gpu", "A100-80GB"], "fits"),
    "alignment-handbook/fsdp.yaml": (ZEPHYR + ["--accelerate-config", "alignment-handbook/fsdp.yaml",
                                               "--gpu", "A100-80GB"], "fits"),
    "alignment-handbook/zero3.yaml": (ZEPHYR + ["--accelerate-config", "alignment-handbook/zero3.yaml",
                                                "--gpu", "A100-80GB"], "fits"),
    "axolotl/fft-8b.yaml": (["--hf-config", "llama-3.1-8b", "--training-args", "axolotl/fft-8b.yaml",
                             "--gpu", "L40S-48GB"], "near:44.70:0.15"),  # 48 GB = 44.70 GiB
    "axolotl/lora-8b-15f7910.yml": (["--hf-config", "{llama2}", "--training-args", "axolotl/lora-8b-15f7910.yml"],
                                    "near:11:0.2"),
    "axolotl/lora-8b.yml": (["--hf-config", "llama-3-8b", "--training-args", "axolotl/lora-8b.yml"],
                            "above:{lora8b_floor}"),
    "axolotl/qlora-fsdp-70b.yaml": (["--hf-config", "llama-3.1-70b", "--training-args",
                                     "axolotl/qlora-fsdp-70b.yaml", "--world-size", "2"], "refuse:LoRA under ZeRO-3"),
    "axolotl/qlora.yml": (["--hf-config", "llama-3-8b", "--training-args", "axolotl/qlora.yml"], "number"),
    "axolotl/zero1.json": (ZEPHYR + ["--deepspeed", "axolotl/zero1.json"] + A100x8, "number"),
    "axolotl/zero2.json": (ZEPHYR + ["--deepspeed", "axolotl/zero2.json"] + A100x8, "number"),
    "axolotl/zero3_bf16.json": (ZEPHYR + ["--deepspeed", "axolotl/zero3_bf16.json"] + A100x8, "fits"),
    "axolotl/zero3_bf16_cpuoffload_all.json": (
        ZEPHYR + ["--deepspeed", "axolotl/zero3_bf16_cpuoffload_all.json"] + A100x8, "fits"),
    "axolotl/zero3_bf16_cpuoffload_params.json": (
        ZEPHYR + ["--deepspeed", "axolotl/zero3_bf16_cpuoffload_params.json"] + A100x8, "fits"),
    "llama-factory/ds_z0_config.json": (ZEPHYR + ["--deepspeed", "llama-factory/ds_z0_config.json"] + A100x8,
                                        "number"),
    "llama-factory/ds_z2_autotp_config.json": (
        ZEPHYR + ["--deepspeed", "llama-factory/ds_z2_autotp_config.json"] + A100x8, "number"),
    "llama-factory/ds_z2_config.json": (ZEPHYR + ["--deepspeed", "llama-factory/ds_z2_config.json"] + A100x8,
                                        "number"),
    "llama-factory/ds_z2_offload_config.json": (
        ZEPHYR + ["--deepspeed", "llama-factory/ds_z2_offload_config.json"] + A100x8, "number"),
    "llama-factory/ds_z3_config.json": (ZEPHYR + ["--deepspeed", "llama-factory/ds_z3_config.json"] + A100x8,
                                        "fits"),
    "llama-factory/ds_z3_offload_config.json": (
        ZEPHYR + ["--deepspeed", "llama-factory/ds_z3_offload_config.json"] + A100x8, "fits"),
    "llama-factory/fsdp_config.yaml": (ZEPHYR + ["--accelerate-config", "llama-factory/fsdp_config.yaml"],
                                       "number"),
    "llama-factory/qwen3_full_sft.yaml": (QWEN3 + ["llama-factory/qwen3_full_sft.yaml"], "number"),
    "llama-factory/qwen3_lora_sft.yaml": (QWEN3 + ["llama-factory/qwen3_lora_sft.yaml"], "number"),
    "llama-factory/qwen3_lora_sft_ds3.yaml": (QWEN3 + ["llama-factory/qwen3_lora_sft_ds3.yaml", "--world-size", "2"],
                                              "refuse:LoRA under ZeRO-3"),
    "llama-factory/qwen3_lora_sft_otfq.yaml": (QWEN3 + ["llama-factory/qwen3_lora_sft_otfq.yaml"], "number"),
    "llm-self-control/deepspeed.py": (ZEPHYR + ["--deepspeed", "{self_control}", "--world-size", "8"],
                                      "refuse:sparse_attention"),
    "models/qwen3-4b-instruct-2507.json": (["--hf-config", "models/qwen3-4b-instruct-2507.json", "--seq", "2048",
                                            "--batch", "1", "--precision", "bf16"], "number"),
    "peft/gemma-2-9b-healthcare_adapter_config.json": (
        ["--hf-config", "gemma-3-12b", "--lora-config", "peft/gemma-2-9b-healthcare_adapter_config.json",
         "--seq", "512", "--batch", "1", "--precision", "bf16"], "number"),
    "peft/llama-3.2-3b-romanian_adapter_config.json": (
        ["--hf-config", "llama-3.1-8b", "--lora-config", "peft/llama-3.2-3b-romanian_adapter_config.json",
         "--seq", "512", "--batch", "1", "--precision", "bf16"], "number"),
    "peft/qwen2.5-7b-mcq_adapter_config.json": (
        ["--hf-config", "qwen2.5-7b", "--lora-config", "peft/qwen2.5-7b-mcq_adapter_config.json",
         "--seq", "512", "--batch", "1", "--precision", "bf16"], "number"),
    "transformers/ds_config_zero3.json": (ZEPHYR + ["--deepspeed", "transformers/ds_config_zero3.json",
                                                    "--world-size", "8"], "refuse:learning_rate"),
    "trl/deepspeed_zero1.yaml": (ZEPHYR + ["--accelerate-config", "trl/deepspeed_zero1.yaml", "--gpu", "A100-80GB"],
                                 "number"),
    "trl/deepspeed_zero2.yaml": (ZEPHYR + ["--accelerate-config", "trl/deepspeed_zero2.yaml", "--gpu", "A100-80GB"],
                                 "number"),
    "trl/deepspeed_zero3.yaml": (ZEPHYR + ["--accelerate-config", "trl/deepspeed_zero3.yaml", "--gpu", "A100-80GB"],
                                 "fits"),
    "trl/multi_gpu.yaml": (QLORA + ["--accelerate-config", "trl/multi_gpu.yaml", "--gpu", "A100-80GB"], "number"),
    "trl/single_gpu.yaml": (QLORA + ["--accelerate-config", "trl/single_gpu.yaml", "--gpu", "A100-80GB"], "number"),
    "trl/grpo_trl_lora_qlora.ipynb": (["--hf-config", "qwen2.5-7b", "--training-args", "{grpo}", "--seq", "256",
                                       "--lora-rank", "{grpo_rank}", "--lora-targets", "{grpo_targets}",
                                       "--load-in-4bit", "--gpu", "T4-16GB"], "fits"),
}


@dataclass(frozen=True)
class Row:
    """One line of a table: the file, what its source says, memlab's answer, and whether they agree."""

    file: str
    claim: str
    answer: str
    consistent: bool


def notebook_call(nb: dict, name: str) -> dict:
    """The literal keyword arguments of the first ``name(...)`` call in a notebook's code cells
    (a keyword whose value is a variable, such as ``output_dir=output_dir``, is left out).

    Args:
        nb: the notebook's JSON.
        name: the called function's or class's name.

    Returns:
        The keywords and their values, a dict (the call's own keywords).
    """
    for cell in nb["cells"]:
        src = "".join(cell["source"]) if cell["cell_type"] == "code" else ""
        if name + "(" not in src:
            continue
        tree = ast.parse("\n".join(line for line in src.splitlines() if not line.lstrip().startswith("!")))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == name:
                out = {}
                for kw in node.keywords:
                    with contextlib.suppress(ValueError):
                        out[kw.arg] = ast.literal_eval(kw.value)
                return out
    raise ValueError(f"no {name}(...) call in the notebook")


def notebook_number(nb: dict, pattern: str) -> float:
    """The first number ``pattern``'s group matches in the notebook's printed outputs."""
    text = "".join("".join(o.get("text", [])) for c in nb["cells"] for o in c.get("outputs", []))
    return float(re.search(pattern, text).group(1))


def lora_8b_floor() -> float:
    """GiB that axolotl's llama-3 lora-8b.yml (today's) needs before any activation, adapter or
    optimizer state: Llama 3 8B's decoder linears in int8 (a byte each; bitsandbytes' row
    scales left out), its embedding and head in bf16, and the fp32 logits transformers' loss
    makes of micro_batch_size 2 x sequence_len 4096 packed tokens over 128,256 tokens."""
    from memlab.hf.shape import decoder_shape
    s = decoder_shape("llama-3-8b")
    linear = sum(i * o for k in range(s.n_layer) for v in s.linears(k).values() for i, o in v)
    return (linear + 2 * (s.num_params() - linear) + 2 * 4096 * s.vocab * 4) / GIB


def _prepare(tmp: pathlib.Path) -> dict[str, str]:
    """The values of :data:`RUNS`' placeholders: files written from the sources' own text."""
    from transformers import LlamaConfig
    llama2 = tmp / "llama-2-7b.json"  # transformers' LlamaConfig defaults are Llama-2-7b-hf's shape
    llama2.write_text(json.dumps(LlamaConfig(max_position_embeddings=4096).to_dict()))
    text = (DATA / "llm-self-control/deepspeed.py").read_text()
    ds = tmp / "self_control.json"
    ds.write_text(json.dumps(ast.literal_eval(text.split("=", 1)[1])))
    nb = json.loads((DATA / "trl/grpo_trl_lora_qlora.ipynb").read_text())
    grpo, lora = tmp / "grpo.json", notebook_call(nb, "LoraConfig")
    grpo.write_text(json.dumps(notebook_call(nb, "GRPOConfig")))
    return {"llama2": str(llama2), "self_control": str(ds), "grpo": str(grpo), "grpo_rank": str(lora["r"]),
            "grpo_targets": ",".join(lora["target_modules"]), "lora8b_floor": f"{lora_8b_floor():.2f}"}


def estimate(argv: list[str]) -> tuple[int, dict | str]:
    """``memlab estimate ARGV --json``: (exit code, the report or the error's last line)."""
    from memlab.app.cli import main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(["estimate", *argv, "--json"])
        except SystemExit as e:
            code = e.code
    if code:
        lines = err.getvalue().strip().splitlines()
        return code, lines[-1] if lines else ""
    return 0, json.loads(out.getvalue())


def judge(expect: str, code: int, rep: dict | str) -> tuple[str, bool]:
    """memlab's answer in words, and whether it agrees with ``expect`` (:data:`RUNS`' kinds)."""
    if code:
        one_line = isinstance(rep, str) and "\n" not in rep
        return f"refused: {rep}", expect.startswith("refuse:") and one_line and expect[7:] in rep
    peak = rep["peak_bytes"] / GIB
    budget = rep.get("budget_bytes")
    fits = rep.get("fits")
    answer = f"{peak:.2f} GiB" + ("" if budget is None else f" of {budget / GIB:.2f} ({'fits' if fits else 'no fit'})")
    kind, _, rest = expect.partition(":")
    if kind == "fits":
        return answer, bool(fits)
    if kind == "no fit":
        return answer, fits is False
    if kind == "number":
        return answer, True
    if kind == "near":
        gib, tol = (float(x) for x in rest.split(":"))
        return answer + f", {peak / gib - 1:+.1%} of {gib:g}", (fits is not False) and abs(peak / gib - 1) <= tol
    if kind == "above":
        return answer + f" > {float(rest):.2f} (arithmetic floor)", peak > float(rest)
    return answer, False


def run_config_rows() -> list[Row]:
    """One :class:`Row` per real run file (:data:`RUNS`), its claim from tests/data/run_configs/index.json."""
    index = {e["file"]: e for e in json.loads((DATA / "index.json").read_text())}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        values = _prepare(pathlib.Path(tmp))
        for name, (argv, expect) in RUNS.items():
            argv = [a.format(**values) for a in argv]
            argv = [str(DATA / a) if (DATA / a).is_file() else a for a in argv]
            code, rep = estimate(argv)
            answer, ok = judge(expect.format(**values), code, rep)
            rows.append(Row(name, index[name]["claim"], answer, ok))
    return rows


def oom_rows() -> list[Row]:
    """One :class:`Row` per real OOM message in tests/data/oom_messages: its thread's statement,
    memlab's cause, and whether it is the cause the statement implies (or the refusal it names)."""
    from memlab.core.errors import InputError
    from memlab.tracking.oom_messages import explain_oom
    rows = []
    for path in sorted(OOM.glob("*.txt")):
        header, body = {}, []
        for line in path.read_text().splitlines():
            if not body and line.startswith("# "):
                key, _, value = line[2:].partition(":")
                header[key.strip()] = value.strip()
            else:
                body.append(line)
        try:
            cause = explain_oom("\n".join(body)).cause
            ok = cause == header.get("expect")
        except InputError as e:
            cause, ok = f"refused: {e}", "refuse" in header and bool(re.search(header["refuse"], str(e)))
        rows.append(Row(path.name, header["says"], cause, ok))
    return rows


def markdown(rows: list[Row], what: str) -> str:
    """The rows as a Markdown table, and a last line counting those that agree."""
    cell = lambda s: s.replace("|", "/").replace("\n", " ")  # noqa: E731 one line a cell
    out = [f"| {what} | the source says | memlab | consistent |", "|---|---|---|---|"]
    out += [f"| {r.file} | {cell(r.claim)} | {cell(r.answer)} | {'yes' if r.consistent else 'NO'} |" for r in rows]
    out.append(f"\n{sum(r.consistent for r in rows)} of {len(rows)} consistent")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    """Print the tables; exit 1 when a row disagrees with its source."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", action="store_true", help="the run files only")
    ap.add_argument("--oom", action="store_true", help="the OOM messages only")
    a = ap.parse_args(argv)
    both = not (a.configs or a.oom)
    rows = []
    if a.configs or both:
        rows += (r := run_config_rows())
        print(markdown(r, "run file"))
    if a.oom or both:
        rows += (r := oom_rows())
        print(("\n" if both else "") + markdown(r, "OOM message"))
    return 0 if all(r.consistent for r in rows) else 1


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
