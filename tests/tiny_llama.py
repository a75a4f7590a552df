"""The tiny Llama configs the post-training tests (estimate and simulation) run TRL's trainers on."""
from memlab.step.fine_tune_config import LoraConfig

TINY = dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
# the backbone's activations and weights outweigh TRL's 32768-wide tile here
WIDE = dict(TINY, vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4)
LORA = LoraConfig(rank=8, targets=("q_proj", "v_proj"))
