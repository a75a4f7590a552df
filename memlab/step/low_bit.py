"""Low-bit and factored state, byte for byte: what bitsandbytes and Adafactor allocate.

**8-bit optimizer state** (Dettmers et al. 2022, "8-bit Optimizers via Block-wise
Quantization", sec. 2.1 and 2.2): each Adam moment is stored in one byte, quantised in
independent blocks that each keep one fp32 absolute maximum, with a 256-entry fp32 dynamic
quantisation map per state. The paper uses blocks of 2048; bitsandbytes 0.50's ``AdamW8bit``
uses 256 (``blocksize = 256`` in its ``Optimizer2State``), and keeps tensors under
``min_8bit_size = 4096`` elements in fp32 (its documentation). :func:`adam_state_bytes` is
that layout, byte for byte (the tests compare it with bitsandbytes where it runs).
Its *paged* variants (``PagedAdamW8bit``, ``PagedAdamW``) allocate the same state with
``bitsandbytes.functional.get_paged`` (``cget_managed_ptr``: CUDA unified memory, outside
torch's caching allocator), which the driver pages out to host memory when the device is
full: the estimate counts it as host bytes, never as the device peak. **Adafactor**
(Shazeer and Stern 2018, sec. 3; ``transformers.optimization.Adafactor`` with its defaults,
``beta1=None``) keeps a row and a column second-moment vector (fp32) per matrix and a full
one per vector: ``4 (r + c)`` and ``4 n`` bytes.

**Quantised base weights** (QLoRA, Dettmers et al. 2023, sec. 3; bitsandbytes 0.50
``functional.quantize_4bit``): every ``Linear`` of the decoder is stored as NF4, two values
per byte (``ceil(n / 2)`` bytes), with one absolute maximum per block of 64: fp32, or with
double quantization (``compress_statistics=True``) the maxima less their mean quantised to
uint8 by ``quantize_blockwise(blocksize=256)``, one fp32 maximum per 256 blocks and the fp32
offset. transformers converts no embedding and keeps the head (``lm_head``) in 16 bits
(``modules_to_not_convert``); norms too stay in the compute dtype. The backward of each
4-bit matmul (``autograd/_functions.py``, ``MatMul4Bit.backward``) dequantises the whole
weight to the compute dtype: one such weight is a temporary. ``load_in_8bit``
(``Linear8bitLt``, ``Int8Params``): one int8 per element and one fp32 scale per output row
(``SCB``). :func:`quantized_weight_bytes` is that layout (tests compare it with bitsandbytes).

**The 8-bit optimizers themselves** (:func:`eight_bit_adamw`): every lens that runs a step with
8-bit state (memlab's GPT and a Hugging Face decoder, real or on fake tensors) builds it here, so
the simulated state is bitsandbytes' own allocation and the estimate's is :func:`adam_state_bytes`.

**torchao's low-bit AdamW** (torchao 0.18 ``torchao.optim``: ``AdamW8bit``, ``AdamW4bit``, ``AdamWFp8``;
:data:`TORCHAO`): each moment of a tensor of ``n >= 4096`` elements with ``n`` a multiple of the
block (``adam.py:75``) is a tensor subclass of codes, one fp32 scale per block and, 8- and 4-bit,
its *own* fp32 code table (``subclass_8bit.py:112-115``, ``subclass_4bit.py:126-129``,
``subclass_fp8.py:93-94``): 8-bit ``n + 4 n / 256 + 4 * 256`` bytes (block 256, ``adam.py:319``),
4-bit ``n / 2 + 4 n / 128 + 4 * 16`` (block 128, ``adam.py:352``; ``create_dynamic_map(True, 3, 4)``
and 16 linear levels), FP8 (E4M3) ``n + 4 n / 256`` (block 256, ``adam.py:385``). Any other tensor
keeps ``torch.zeros_like(p)``: two moments in the *parameter's* dtype (``adam.py:78``), not fp32 as
bitsandbytes. The step counter is ``torch.tensor(0.0)`` (``adam.py:124``): 4 bytes per tensor on the
host whatever the parameter's device, and the learning rate one fp32 tensor per group (``adam.py:59``).
:func:`torchao_state_bytes` is that layout; :func:`torchao_adamw` builds the optimizer.

torchao compiles each tensor's update (``torch.compile(single_param_adam, fullgraph=True)``,
``adam.py:142``); the compiled CPU update of a quantised tensor allocates, besides its own
outputs, buffers the allocator's events show (torch 2.13 inductor, this CPU, fp32 and bf16 weights
alike; tests/test_torchao_optim.py): per moment its new block scales (``4 n / block``), and the
8-bit update one fp32 copy of the scaled moment (``4 n``), the 4-bit one that, the int64 codes of
``quantize_4bit_with_qmap`` (``8 n``) and the unpacked uint8 codes (``n``) (``quant_utils.py:95-106``):
8-bit ``8 n``, 4-bit ``26 n``, FP8 none, over the two moments, plus the scales
(:func:`torchao_update_bytes`). Not followed: inductor's other choices for some shapes (a 3-d 8-bit
moment adds ``4 n`` fp32 / ``2 n`` bf16; an FP8 (64, 128) update ``2 n``); a CUDA target's
Triton update, unmeasured here.
"""
from __future__ import annotations

import math
from typing import Iterable

import torch

from memlab.core.errors import InputError
from memlab.core.torch_private import outside_dispatch_modes

#: bitsandbytes 8-bit Adam layout (module doc)
BNB_BLOCK = 256
BNB_MIN_8BIT_SIZE = 4096
QMAP_ENTRIES = 256
#: torchao 0.18 low-bit AdamW (module doc): name -> (default block, bits of a code, code-table entries)
TORCHAO_LAYOUTS = {"torchao-adamw-8bit": (256, 8, 256), "torchao-adamw-4bit": (128, 4, 16),
                   "torchao-adamw-fp8": (256, 8, 0),
                   # transformers' Trainer (``adamw_torch_4bit``) passes ``block_size`` 256 to AdamW4bit
                   # (transformers 5.23 trainer_optimizer.py:470, ``optim_args.get("block_size", 256)``)
                   "torchao-adamw-4bit-256": (256, 4, 16)}
TORCHAO = tuple(TORCHAO_LAYOUTS)
TORCHAO_MIN_SIZE = 4096  # torchao/optim/adam.py:75, "follow bitsandbytes"
TORCHAO_STEP_BYTES = 4  # torch.tensor(0.0), adam.py:124: host memory, one per tensor
OPTIMIZER_STATES = ("adamw", "adamw-8bit", "paged-adamw-8bit", "paged-adamw", "adafactor", "sgd", *TORCHAO)
#: moments an optimizer keeps per parameter, each the parameter's size: Adam/AdamW's first and
#: second moment (Kingma and Ba 2015, Algorithm 1: m and v), SGD's momentum buffer
MOMENTS = {"adamw": 2, "sgd": 1}
PAGED = ("paged-adamw-8bit", "paged-adamw")  # large tensors' state in CUDA unified memory (host bytes here)
#: bitsandbytes pages a tensor's state only from this many elements on (0.50 ``optim/optimizer.py``,
#: ``get_state_buffer``, line 383: ``p.numel() < 1e5`` gives an ordinary device tensor)
BNB_PAGED_MIN_SIZE = 100_000
#: bitsandbytes' 8-bit AdamW, plain and paged (``AdamW8bit``, ``PagedAdamW8bit``): the states memlab's
#: own GPT runs beside :data:`MOMENTS`' (:func:`eight_bit_adamw`)
EIGHT_BIT = ("adamw-8bit", "paged-adamw-8bit")
#: every blockwise-quantised state whose layout :func:`adam_state_bytes` counts per tensor
BLOCKWISE = (*EIGHT_BIT, *TORCHAO)
#: Hugging Face ``TrainingArguments.optim`` names -> the state memlab counts
HF_OPTIMIZERS = {"adamw_torch": "adamw", "adamw_torch_fused": "adamw", "adamw_hf": "adamw",
                 "adamw_apex_fused": "adamw", "adamw_torch_xla": "adamw",
                 "adamw_bnb_8bit": "adamw-8bit", "adamw_8bit": "adamw-8bit",
                 "paged_adamw_8bit": "paged-adamw-8bit", "paged_adamw_32bit": "paged-adamw",
                 "paged_adamw": "paged-adamw", "adafactor": "adafactor", "sgd": "sgd",
                 # torchao's, as the Trainer builds them (_get_torchao_optimizer: block 256 for both)
                 "adamw_torch_8bit": "torchao-adamw-8bit", "adamw_torch_4bit": "torchao-adamw-4bit-256"}
#: bitsandbytes 4-bit layout (module doc)
NF4_BLOCK = 64
NESTED_BLOCK = 256
NF4_CODE = 16  # entries of the NF4/FP4 code table each 4-bit weight's state holds
QUANTIZATIONS = ("none", "4bit", "8bit")


def moment_bytes(optimizer: str, element_bytes: int = 4) -> int:
    """Optimizer state bytes per parameter of ``optimizer`` (a key of :data:`MOMENTS`) whose
    moments are ``element_bytes`` each: 8 for AdamW's two fp32 moments, 4 for SGD's momentum."""
    if optimizer not in MOMENTS:
        raise InputError(f"optimizer={optimizer!r}; allowed: {', '.join(MOMENTS)}")
    return MOMENTS[optimizer] * element_bytes


def torchao_moment_bytes(n: int, kind: str, element_bytes: int = 4) -> int:
    """Bytes of one torchao moment buffer (``_new_buffer``, ``adam.py:72-78``) over a tensor of ``n``
    elements whose parameter has ``element_bytes`` per element (module doc)."""
    if kind not in TORCHAO_LAYOUTS:
        raise InputError(f"optimizer state {kind!r}; allowed: {', '.join(TORCHAO)}")
    block, bits, entries = TORCHAO_LAYOUTS[kind]
    if n < TORCHAO_MIN_SIZE or n % block:
        return element_bytes * n
    return n * bits // 8 + 4 * (n // block) + 4 * entries


#: bytes per element the compiled CPU update of a quantised tensor allocates besides its scales (module doc)
TORCHAO_UPDATE_RATE = {"torchao-adamw-8bit": 8, "torchao-adamw-4bit": 26, "torchao-adamw-fp8": 0,
                       "torchao-adamw-4bit-256": 26}


def torchao_update_bytes(n: int, kind: str) -> int:
    """What torchao's compiled update of one tensor of ``n`` elements allocates while it runs (module
    doc): nothing for an unquantised tensor (a few scalars), else :data:`TORCHAO_UPDATE_RATE` bytes an
    element and both moments' new block scales."""
    block, _, _ = TORCHAO_LAYOUTS[kind]
    if n < TORCHAO_MIN_SIZE or n % block:
        return 0
    return TORCHAO_UPDATE_RATE[kind] * n + 2 * 4 * (n // block)


def torchao_state_bytes(shapes: Iterable[int], kind: str, element_bytes: int = 4) -> int:
    """torchao's low-bit AdamW state over tensors of ``shapes`` (element counts): two moments per
    tensor (:func:`torchao_moment_bytes`); the host step counters are :data:`TORCHAO_STEP_BYTES` each."""
    return sum(2 * torchao_moment_bytes(n, kind, element_bytes) for n in shapes)


def adam_state_bytes(shapes: Iterable[int], kind: str = "adamw", *, per_tensor: bool = False,
                     element_bytes: int = 4) -> int:
    """Optimizer state bytes of Adam/AdamW over tensors of ``shapes`` (element counts):
    ``"adamw"`` (and ``"paged-adamw"``) two fp32 moments (8 B per parameter); ``"adamw-8bit"``
    (and ``"paged-adamw-8bit"``) bitsandbytes' layout (module doc): per tensor of n >= 4096
    elements ``2 n`` bytes of moments and ``2 * 4 * ceil(n / 256)`` of block maxima, else fp32,
    and the two 256-entry fp32 quantisation maps once (``Optimizer2State.init_state`` gives every
    state the optimizer's own ``name2qmap`` tensors); ``"sgd"`` one fp32 momentum. The step
    counters (a few bytes per tensor, or none) are not counted. Adafactor needs the matrix
    shapes: :func:`adafactor_state_bytes`. ``per_tensor``: one optimizer per tensor (the step in
    backward, :mod:`memlab.step.optimizer_in_backward`), each 8-bit one with its own two maps.
    torchao's (:data:`TORCHAO`): :func:`torchao_state_bytes`, whose unquantised tensors keep their
    moments in the parameter's ``element_bytes``."""
    if kind in TORCHAO:
        return torchao_state_bytes(shapes, kind, element_bytes)
    if kind not in OPTIMIZER_STATES or kind == "adafactor":
        allowed = ", ".join(k for k in OPTIMIZER_STATES if k != "adafactor")
        raise InputError(f"optimizer state {kind!r} from element counts; allowed: {allowed}")
    total, maps = 0, 0
    for n in shapes:
        if kind == "sgd":
            total += moment_bytes("sgd") * n
        elif kind in ("adamw", "paged-adamw") or n < BNB_MIN_8BIT_SIZE:
            total += moment_bytes("adamw") * n
        else:
            total += 2 * n + 2 * 4 * math.ceil(n / BNB_BLOCK)
            maps = maps + 2 * 4 * QMAP_ENTRIES if per_tensor else 2 * 4 * QMAP_ENTRIES
    return total + maps


def paged_state_bytes(shapes: Iterable[int], kind: str, *, moment_element_bytes: int = 4) -> int:
    """The part of a paged optimizer's state that bitsandbytes puts in CUDA unified memory.

    Only the moments of a tensor of :data:`BNB_PAGED_MIN_SIZE` elements or more are paged
    (``get_paged``). The rest is ordinary device tensors: the smaller tensors' moments, every 8-bit
    tensor's block maxima (``absmax1``/``absmax2``, bitsandbytes 0.50 ``optim/optimizer.py``
    lines 528-529) and the quantisation maps.

    Args:
        shapes: element counts of the tensors the optimizer steps.
        kind: ``"paged-adamw-8bit"`` (two uint8 moments) or ``"paged-adamw"`` (two moments of
            ``moment_element_bytes``).

    Returns:
        Bytes in unified memory; the device keeps :func:`adam_state_bytes` less these.
    """
    if kind not in PAGED:
        raise InputError(f"optimizer={kind!r} is not paged; allowed: {', '.join(PAGED)}")
    per_element = 2 if kind == "paged-adamw-8bit" else 2 * moment_element_bytes
    return sum(per_element * n for n in shapes if n >= BNB_PAGED_MIN_SIZE)


def paged_note(kind: str, state: int, paged: int) -> str:
    """What a lens says of a paged optimizer's ``state`` bytes, ``paged`` of them in unified memory."""
    return (f"{kind}: {paged / 2**20:.1f} MiB of its {state / 2**20:.1f} MiB of state in CUDA unified memory "
            f"(bitsandbytes get_paged: the moments of tensors of {BNB_PAGED_MIN_SIZE:,} elements or more), "
            f"paged to the host when the device is full: host bytes; the rest (smaller tensors' moments, "
            f"block maxima, maps) on the device")


def eight_bit_adamw(params: list, optimizer: str, lr: float = 1e-4, fake: bool = False) -> torch.optim.Optimizer:
    """bitsandbytes' ``AdamW8bit`` (``"adamw-8bit"``) or ``PagedAdamW8bit`` (``"paged-adamw-8bit"``)
    over ``params``. On fake tensors (``fake=True``) both run as ``AdamW8bit`` with its two
    quantisation maps made fake (:func:`fake_qmaps`): the same state (bitsandbytes' ops have fake
    kernels), since unified memory cannot be faked; the lenses put a paged state in host bytes.
    On a CPU tensor ``PagedAdamW8bit`` itself falls back to ordinary tensors (bitsandbytes 0.50
    ``optim/optimizer.py:375-382``, ``get_state_buffer``)."""
    import bitsandbytes as bnb
    if optimizer not in EIGHT_BIT:
        raise InputError(f"optimizer={optimizer!r}; allowed: {', '.join(EIGHT_BIT)}")
    if fake:
        return fake_qmaps(bnb.optim.AdamW8bit)(params, lr=lr)
    cls = bnb.optim.AdamW8bit if optimizer == "adamw-8bit" else bnb.optim.PagedAdamW8bit
    return cls(params, lr=lr)


def torchao_adamw(params: list, optimizer: str, lr: float = 1e-4, fake: bool = False) -> torch.optim.Optimizer:
    """torchao's ``AdamW8bit``, ``AdamW4bit`` or ``AdamWFp8`` (:data:`TORCHAO`) over ``params``, with
    its default block (``"torchao-adamw-4bit-256"``: AdamW4bit with the Trainer's block of 256). On
    fake tensors (``fake=True``) the same class with its update run eagerly
    (:func:`eager_update`): torchao compiles it with ``fullgraph=True`` (``adam.py:142``), which refuses
    to run under a dispatch mode (the simulation's tracker); the state is torchao's own subclasses."""
    import torchao.optim  # optional (memlab[hf]) and heavy, as bitsandbytes
    if optimizer not in TORCHAO:
        raise InputError(f"optimizer={optimizer!r}; allowed: {', '.join(TORCHAO)}")
    cls = {"torchao-adamw-8bit": torchao.optim.AdamW8bit, "torchao-adamw-4bit": torchao.optim.AdamW4bit,
           "torchao-adamw-fp8": torchao.optim.AdamWFp8,
           "torchao-adamw-4bit-256": torchao.optim.AdamW4bit}[optimizer]
    block = TORCHAO_LAYOUTS[optimizer][0]
    return (eager_update(cls, optimizer) if fake else cls)(params, lr=lr, block_size=block)


def eager_update(cls: type, kind: str) -> type:
    """``cls`` (a torchao ``_AdamBase`` of layout ``kind``) whose ``step`` is torchao's own loop
    (``adam.py:106-158``: state made by ``_new_buffer`` at the first step, step counter, then
    ``single_param_adam`` per tensor) with the update called as written rather than through
    ``torch.compile``, outside the tracker, and the compiled update's buffers
    (:func:`torchao_update_bytes`) allocated in its place."""
    from torchao.optim import subclass_4bit, subclass_8bit
    from torchao.optim.adam import single_param_adam
    # the code tables are computed once from values (lru_cache, subclass_8bit.py:30-37,
    # subclass_4bit.py:34-41), which a fake tensor has none of: computed on real tensors here
    with outside_dispatch_modes():
        for module in (subclass_8bit, subclass_4bit):
            module.get_qmap_signed(), module.get_qmap_unsigned()

    class Eager(cls):
        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    state = self.state[p]
                    if len(state) == 0:
                        state["step"] = torch.tensor(0.0)
                        state["exp_avg"] = self._new_buffer(p, True)
                        state["exp_avg_sq"] = self._new_buffer(p, False)
                    state["step"] += 1
                    # outside the tracker: the eager update's fp32 temporaries are not the compiled one's
                    with outside_dispatch_modes():
                        single_param_adam(p.detach(), p.grad, state["step"], state["exp_avg"], state["exp_avg_sq"],
                                          None, group["lr"], group["betas"][0], group["betas"][1],
                                          group["weight_decay"], group["eps"], self.is_adamw,
                                          self.bf16_stochastic_round and p.dtype is torch.bfloat16)
                    # the compiled update's own buffers, tracked while it runs (torchao_update_bytes)
                    scratch = torch.empty(torchao_update_bytes(p.numel(), kind), dtype=torch.uint8, device=p.device)
                    del scratch
    return Eager


def fake_qmaps(cls: type) -> type:
    """``cls`` (a bitsandbytes 8-bit optimizer) with its two quantisation maps made as fake tensors
    of their real size (``create_dynamic_map``'s 256 fp32 entries, ``Optimizer8bit.fill_qmap``),
    since building them reads values a fake tensor does not have; everything else is bitsandbytes' own."""
    class Fake8bit(cls):
        def fill_qmap(self) -> None:
            for name in ("dynamic", "udynamic"):
                self.name2qmap[name] = torch.empty(QMAP_ENTRIES, dtype=torch.float32)
    return Fake8bit


def adafactor_state_bytes(shapes: Iterable[tuple[int, ...]]) -> int:
    """Adafactor's state (module doc) over parameters of ``shapes``: a matrix (the last two
    dimensions factored, as transformers' ``_get_options`` decides for ``len(shape) >= 2``)
    keeps ``4 (rows + cols)`` bytes per leading index, a vector ``4 n``."""
    total = 0
    for shape in shapes:
        if len(shape) >= 2:
            lead = math.prod(shape[:-2])
            total += 4 * lead * (shape[-2] + shape[-1])
        else:
            total += 4 * math.prod(shape)
    return total


def quantized_weight_bytes(out_features: int, in_features: int, quantization: str = "4bit", *,
                           double_quant: bool = True, blocksize: int = NF4_BLOCK) -> int:
    """Bytes of one ``Linear(in, out)`` weight as bitsandbytes stores it (module doc):
    ``"4bit"`` NF4 packed two per byte plus the block maxima (double quantised or fp32), the
    offset and the state's own code tables; ``"8bit"`` int8 plus one fp32 scale per row.

    Every 4-bit weight's ``QuantState`` holds its own copy of the 16-entry NF4 code
    (``get_4bit_type`` makes a new tensor each call, bitsandbytes 0.50.2 ``functional.py:854``,
    called at ``:936``) and, double quantised, of the 256-entry map of its nested maxima
    (``code.to(A.device, copy=True)``, ``:670``): 64 and 1,024 fp32 bytes a weight."""
    n = out_features * in_features
    if quantization == "8bit":
        return n + 4 * out_features
    if quantization != "4bit":
        raise InputError(f"quantization {quantization!r}; allowed: 4bit, 8bit")
    blocks = math.ceil(n / blocksize)
    if not double_quant:
        return math.ceil(n / 2) + 4 * blocks + 4 * NF4_CODE
    return math.ceil(n / 2) + blocks + 4 * math.ceil(blocks / NESTED_BLOCK) + 4 + 4 * (NF4_CODE + QMAP_ENTRIES)


__all__ = ["BNB_BLOCK", "BNB_MIN_8BIT_SIZE", "QMAP_ENTRIES", "OPTIMIZER_STATES", "MOMENTS", "moment_bytes",
           "PAGED", "BNB_PAGED_MIN_SIZE", "paged_note", "paged_state_bytes", "EIGHT_BIT", "BLOCKWISE", "TORCHAO",
           "TORCHAO_LAYOUTS", "TORCHAO_MIN_SIZE",
           "TORCHAO_STEP_BYTES", "TORCHAO_UPDATE_RATE", "torchao_update_bytes", "torchao_moment_bytes",
           "torchao_state_bytes", "torchao_adamw", "eager_update",
           "eight_bit_adamw", "fake_qmaps", "HF_OPTIMIZERS", "NF4_BLOCK",
           "NESTED_BLOCK", "NF4_CODE",
           "QUANTIZATIONS", "adam_state_bytes", "adafactor_state_bytes", "quantized_weight_bytes"]
