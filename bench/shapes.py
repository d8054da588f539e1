"""Model shapes for benchmarks: HF config dicts of public Llama and Qwen3 models (random init, no
download)."""

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

SHAPES = {
    "llama-3.2-1b": dict(model_type="llama", vocab_size=128256, hidden_size=2048,
                         intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5,
                         rope_theta=500000.0, rope_scaling=LLAMA3_ROPE,
                         max_position_embeddings=131072, tie_word_embeddings=True,
                         bos_token_id=128000, eos_token_id=128001),
    "llama-3.1-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096,
                         intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5,
                         rope_theta=500000.0, rope_scaling=dict(LLAMA3_ROPE, factor=8.0),
                         max_position_embeddings=131072, tie_word_embeddings=False,
                         bos_token_id=128000, eos_token_id=128001),
    "qwen3-0.6b": dict(model_type="qwen3", vocab_size=151936, hidden_size=1024,
                       intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
                       rope_theta=1000000.0, rope_scaling=None, max_position_embeddings=40960,
                       tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645),
    "qwen3-14b": dict(model_type="qwen3", vocab_size=151936, hidden_size=5120,
                      intermediate_size=17408, num_hidden_layers=40, num_attention_heads=40,
                      num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
                      rope_theta=1000000.0, rope_scaling=None, max_position_embeddings=40960,
                      tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645),
    # Qwen3-14B's layers, 8 of them (an fp32 check at the real head shapes fits in minutes)
    "qwen3-14b-8l": dict(model_type="qwen3", vocab_size=151936, hidden_size=5120,
                         intermediate_size=17408, num_hidden_layers=8, num_attention_heads=40,
                         num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
                         rope_theta=1000000.0, rope_scaling=None, max_position_embeddings=40960,
                         tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645),
    # CPU-sized shapes for dry runs of the harness
    "tiny-qwen3": dict(model_type="qwen3", vocab_size=1000, hidden_size=64, intermediate_size=160,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=16, rms_norm_eps=1e-6, rope_theta=1000000.0, rope_scaling=None,
                       max_position_embeddings=4096, tie_word_embeddings=True,
                       bos_token_id=1, eos_token_id=2),
    "tiny": dict(model_type="llama", vocab_size=1000, hidden_size=64, intermediate_size=160,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE,
                 max_position_embeddings=4096, tie_word_embeddings=False,
                 bos_token_id=1, eos_token_id=2),
}
