"""Small configs of today's decoder families, built from each family's transformers config
class (``AutoConfig.for_model``), for the lens-agreement tests of tests/test_hf*.py."""
import pytest

V, D, L = 512, 128, 2
FAMILIES = {
    # dense, head_dim set apart from hidden/heads, q/k RMSNorms, GQA
    "qwen3": dict(model_type="qwen3", vocab_size=V, hidden_size=D, intermediate_size=256,
                  num_hidden_layers=L, num_attention_heads=4, num_key_value_heads=2, head_dim=48,
                  max_position_embeddings=1024, tie_word_embeddings=False),
    # softcapped logits (eager only), alternating sliding window, tied head, four norms a layer
    "gemma2": dict(model_type="gemma2", vocab_size=V, hidden_size=D, intermediate_size=256,
                   num_hidden_layers=L, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                   sliding_window=64, max_position_embeddings=1024, query_pre_attn_scalar=32),
    "gemma3": dict(model_type="gemma3_text", vocab_size=V, hidden_size=D, intermediate_size=256,
                   num_hidden_layers=L, num_attention_heads=4, num_key_value_heads=1, head_dim=48,
                   sliding_window=64, max_position_embeddings=1024, query_pre_attn_scalar=48),
    # fused qkv and gate_up projections
    "phi3": dict(model_type="phi3", vocab_size=V, hidden_size=D, intermediate_size=256,
                 num_hidden_layers=L, num_attention_heads=4, num_key_value_heads=4,
                 max_position_embeddings=1024, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    # dropout 0.1 on attention, residual and embeddings; tied head; learned positions
    "gpt2": dict(model_type="gpt2", vocab_size=V, n_embd=D, n_layer=L, n_head=4, n_positions=1024),
    "mixtral": dict(model_type="mixtral", vocab_size=V, hidden_size=D, intermediate_size=192,
                    num_hidden_layers=L, num_attention_heads=4, num_key_value_heads=2,
                    num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=1024),
    "qwen3_moe": dict(model_type="qwen3_moe", vocab_size=V, hidden_size=D, intermediate_size=256,
                      moe_intermediate_size=64, num_hidden_layers=L, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
                      norm_topk_prob=True, max_position_embeddings=1024),
    # multi-head latent attention, shared expert, a first dense layer, grouped routing
    "deepseek_v3": dict(model_type="deepseek_v3", vocab_size=V, hidden_size=D, intermediate_size=256,
                        moe_intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                        num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1,
                        num_experts_per_tok=2, first_k_dense_replace=1, n_group=2, topk_group=1,
                        q_lora_rank=64, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=32,
                        v_head_dim=32, max_position_embeddings=1024),
    # experts with biases, attention sinks, alternating sliding window
    "gpt_oss": dict(model_type="gpt_oss", vocab_size=V, hidden_size=D, intermediate_size=128,
                    num_hidden_layers=L, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                    num_local_experts=4, num_experts_per_tok=2, sliding_window=64,
                    max_position_embeddings=1024),
}
SEQ, BATCH = 128, 2

#: The families a per-family matrix runs in the default ``make test``: Llama (the reference
#: dense decoder), Qwen3 (grouped k/v, q/k norms, its own head dim), Gemma 2 (eager,
#: soft-capped logits, four norms a layer), GPT-2 (dropout, learned positions, Conv1D) and
#: DeepSeek-V3 (latent attention, shared and routed experts). Between them they take every
#: path the others take; each matrix's other families run under ``make test-slow``
#: (``-m slow``), so every family is still held to every bound there.
DEFAULT_RUN = ("llama", "qwen3", "gemma2", "gpt2", "deepseek_v3")


def family_marks(name: str, *marks) -> list:
    """``marks`` for a case of family ``name``, with ``slow`` added outside :data:`DEFAULT_RUN`."""
    return [*marks, *([] if name in DEFAULT_RUN else [pytest.mark.slow])]
