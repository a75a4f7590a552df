"""memlab in the learner's own run: the Trainer callback and the plain-loop watch, on a tiny
Llama built from its config on the CPU (no download)."""
import io
import sys

import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from memlab.hf.callbacks import memory_watch
from memlab.lenses.your_model import track_step

transformers = pytest.importorskip("transformers")

SEQ, BATCH, VOCAB = 16, 4, 128


def tiny_llama() -> torch.nn.Module:
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                   max_position_embeddings=SEQ)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def dataset(n: int = 3 * BATCH) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    return [{"input_ids": r, "labels": r.clone()} for r in rows]


def trainer_for(model, callback, tmp_path, steps: int):
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=BATCH, max_steps=steps, use_cpu=True,
        report_to=[], save_strategy="no", logging_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0, optim="adamw_torch", max_grad_norm=1.0, seed=0)
    return transformers.Trainer(model=model, args=args, train_dataset=dataset(), callbacks=[callback])


@pytest.mark.slow  # a Trainer: transformers and accelerate import for tens of seconds on 2 cores
def test_trainer_callback_report_equals_track_step_of_the_same_step(tmp_path):
    from memlab.hf.callbacks import MemoryCallback

    callback = MemoryCallback(steps=2)
    trainer = trainer_for(tiny_llama(), callback, tmp_path, steps=2)
    trainer.train()
    assert len(callback.reports) == 2 and _get_current_dispatch_mode() is None
    # the same step, as a learner writes it with accelerate: forward and loss as the Trainer
    # computes them, accelerate's backward (it divides the loss by its accumulation steps: one
    # more scalar), clipping, the optimizer and scheduler, zero_grad
    model, opt, sched = trainer.model, trainer.optimizer, trainer.lr_scheduler
    batch = transformers.default_data_collator(dataset()[:BATCH])
    items = (batch["labels"][:, 1:] != -100).sum()

    def step():
        model.train()
        loss = trainer.compute_loss(model, batch, num_items_in_batch=items)
        trainer.accelerator.backward(loss)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # kept to be logged
        opt.step()
        sched.step()
        model.zero_grad()
        return grad_norm

    ref = track_step(step, model=model, optimizer=opt.optimizer, warmup=False)
    steady = callback.reports[1]
    assert steady.by_category == ref.by_category
    assert steady.peak_bytes == ref.peak_bytes
    # and it is a real step: parameters and AdamW's two moments of every parameter
    n = sum(p.numel() for p in model.parameters())
    assert steady.by_category["parameters"] == 4 * n and steady.by_category["optimizer"] >= 8 * n
    assert callback.reports[0].by_category["optimizer"] < steady.by_category["optimizer"]


@pytest.mark.slow
def test_an_oom_in_the_trainer_is_explained_and_the_tracker_left(tmp_path):
    from memlab.hf.callbacks import MemoryCallback

    stream = io.StringIO()
    model = tiny_llama()
    n = sum(p.numel() for p in model.parameters())
    callback = MemoryCallback(steps=1, budget=4 * n * 3, stream=stream)  # no room for activations
    trainer = trainer_for(model, callback, tmp_path, steps=1)
    with pytest.raises(torch.OutOfMemoryError) as info:
        trainer.train()
    assert sys.excepthook is callback._hook  # what an uncaught OOM would run
    err = io.StringIO()
    monkey = sys.stderr
    sys.stderr = err
    try:
        sys.excepthook(info.type, info.value, info.tb)
    finally:
        sys.stderr = monkey
    assert _get_current_dispatch_mode() is None and sys.excepthook is not callback._hook
    text = stream.getvalue()
    assert callback.explanation.cause == "simulated budget"
    assert "simulated device" in text and "memlab's tracker at the failing op" in text
    assert "Traceback" in err.getvalue()  # the traceback is still printed


def test_plain_loop_watch_equals_track_step_and_explains_an_oom():
    """The fast sibling of the Trainer tests: the same StepWatch, driven by a plain loop."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(32, 64)

    def step():
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    with memory_watch(model, opt, steps=2) as watch:
        for _ in range(3):
            with watch.step():
                step()
    assert len(watch.reports) == 2
    assert watch.reports[1].by_category == track_step(step, model=model, optimizer=opt, warmup=False).by_category
    stream = io.StringIO()
    with pytest.raises(torch.OutOfMemoryError):
        with memory_watch(model, opt, steps=1, budget=200_000, stream=stream) as watch:
            with watch.step():
                step()
    assert _get_current_dispatch_mode() is None
    assert watch.explanation.cause == "simulated budget" and "budget" in stream.getvalue()
