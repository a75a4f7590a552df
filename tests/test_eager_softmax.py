"""The dtype of the probabilities HF's eager attention saves (memlab.lenses.decoder_estimate.eager_softmax_bytes),
read off transformers' own ``eager_attention_forward`` run on CPU: gpt-oss's softmax takes its
logits' dtype (fp32 where autocast's scores meet the fp32 mask and sinks, bf16 in a bf16 model:
a QLoRA base in its compute dtype), Llama's always fp32. The estimate of gpt-oss's QLoRA step
read +13.71% of the real step while it counted an fp32 softmax and its bf16 copy there."""
import pytest
import torch
from test_hf_lora import CONFIGS
from transformers import AutoConfig
from transformers.models.gpt_oss import modeling_gpt_oss
from transformers.models.llama import modeling_llama

from memlab.hf.shape import decoder_shape
from memlab.lenses.decoder_estimate import Sizes, eager_softmax_bytes
from memlab.policy import resolve_target

B, S = 2, 16
MODELING = {"gpt_oss": (modeling_gpt_oss, "GptOssAttention"), "llama": (modeling_llama, "LlamaAttention")}
#: run -> (weights' dtype, autocast to bf16, Sizes' w/c/r/auto as estimate_run sets them)
RUNS = {"fp32": (torch.float32, False, (4, 4, 4, False)),
        "qlora-bf16": (torch.bfloat16, False, (2, 2, 2, False)),
        "autocast-bf16": (torch.float32, True, (4, 2, 4, True))}


def saved_by_eager_attention(family: str, weights: torch.dtype, autocast: bool) -> list[torch.Tensor]:
    """Every tensor the family's ``eager_attention_forward`` saves for backward: q, k and v as the
    projections hand them (compute dtype), the causal mask in the embeddings' (weights') dtype."""
    cfg = AutoConfig.for_model(**CONFIGS[family])
    module_of, cls = MODELING[family]
    attn = getattr(module_of, cls)(cfg, layer_idx=0).to(weights)
    if family == "gpt_oss":  # the sinks are made with torch.empty
        torch.nn.init.normal_(attn.sinks)
    hd, c = attn.head_dim, torch.bfloat16 if autocast else weights
    q = torch.randn(B, cfg.num_attention_heads, S, hd, dtype=c, requires_grad=True)
    k, v = (torch.randn(B, cfg.num_key_value_heads, S, hd, dtype=c, requires_grad=True) for _ in range(2))
    mask = torch.full((S, S), torch.finfo(weights).min, dtype=weights).triu(1).expand(B, 1, S, S)
    kept = []
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast), \
            torch.autograd.graph.saved_tensors_hooks(lambda x: kept.append(x) or x, lambda x: x):
        module_of.eager_attention_forward(attn, q, k, v, mask, scaling=hd ** -0.5)
    return kept


@pytest.mark.parametrize("family", MODELING)
@pytest.mark.parametrize("run", RUNS)
def test_saved_probabilities_take_the_dtype_the_estimate_counts(family, run):
    weights, autocast, (w, c, r, auto) = RUNS[run]
    kept = saved_by_eager_attention(family, weights, autocast)
    # the probabilities: the softmax's output (gpt-oss's with its sink column) and any copy of
    # them (the matmul saves its 3-d view)
    probs = [x for x in kept if x.dim() >= 3 and x.shape[-2] == S and x.shape[-1] in (S, S + 1)]
    z = Sizes(w=w, c=c, r=r, auto=auto, target=resolve_target("cpu"), precision=run)
    counted = eager_softmax_bytes(decoder_shape(CONFIGS[family]), z)
    elems = {x.element_size() for x in probs}
    # the softmax in ``counted`` bytes (the larger), and a copy in the compute dtype for the
    # matmul exactly when the two differ
    assert elems == {counted, c}, (run, elems)
