"""Random small configs of the LLaMA family's other members, shared by the conversion, generation,
training and LoRA tests (transformers config fields, ``model_type`` choosing the family)."""

# The LLaMA family's other members (msllm/models/llama/families.py), random and small; the special
# ids are LLaMA's so that generation stops at the same EOS on both sides. The sliding window (16)
# is shorter than the longest prompt (26 tokens) plus the 32 new tokens.
_SPECIAL = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
FAMILY_CASES = {
    # Qwen2: q/k/v biases, o without; YaRN rotary scaling (as Qwen2.5 documents it)
    "qwen2_bias_yarn": dict(model_type="qwen2", vocab_size=600, hidden_size=64, intermediate_size=80,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            rope_theta=1e6, max_position_embeddings=256, **_SPECIAL,
                            rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
    # Qwen3: q/k norms, head_dim 32 with 4 heads at hidden 64 (H * D = 128 != C)
    "qwen3_qknorm_head_dim": dict(model_type="qwen3", vocab_size=600, hidden_size=64, intermediate_size=96,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                  max_position_embeddings=128, **_SPECIAL),
    # Mistral v0.1: sliding window 16
    "mistral_window16": dict(model_type="mistral", vocab_size=600, hidden_size=64, intermediate_size=96,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, sliding_window=16,
                             max_position_embeddings=128, **_SPECIAL),
    # Gemma: (1 + w) norms, GeGLU, embeddings x sqrt(64), tied, multi-query, head_dim 24 != 64 / 4
    "gemma_geglu_mqa": dict(model_type="gemma", vocab_size=600, hidden_size=64, intermediate_size=96,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, head_dim=24,
                            max_position_embeddings=128, **_SPECIAL),
    # LlamaConfig.attention_bias (InternLM-1): biases on q, k, v and o
    "llama_attention_bias": dict(model_type="llama", vocab_size=600, hidden_size=48, intermediate_size=64,
                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                 attention_bias=True, max_position_embeddings=128),
}

# Mixture of experts (msllm/models/llama/moe.py): 4 experts, top 2, the load-balancing loss on
# (output_router_logits: transformers adds router_aux_loss_coef x the loss to its training loss)
_MOE = dict(vocab_size=600, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=128, num_experts_per_tok=2, router_aux_loss_coef=0.05,
            output_router_logits=True, **_SPECIAL)
FAMILY_CASES.update({
    # Mixtral: the chosen weights renormalised, experts of the model's intermediate_size
    "mixtral_moe": dict(model_type="mixtral", num_local_experts=4, intermediate_size=48, **_MOE),
    # Qwen3-MoE: q/k norms, head_dim 32, top-k renormalised, layer 1 a dense MLP (mlp_only_layers)
    "qwen3_moe_normed": dict(model_type="qwen3_moe", num_experts=4, moe_intermediate_size=32, intermediate_size=80,
                             head_dim=32, norm_topk_prob=True, mlp_only_layers=[1], **_MOE),
    # Qwen3-MoE without renormalisation, every second layer sparse (decoder_sparse_step 2: layer 1 only)
    "qwen3_moe_unnormed": dict(model_type="qwen3_moe", num_experts=4, moe_intermediate_size=32,
                               intermediate_size=80, head_dim=16, norm_topk_prob=False, decoder_sparse_step=2, **_MOE),
    # Qwen2-MoE: q/k/v biases, a shared expert (48 wide) scaled by its sigmoid gate, no renormalisation
    "qwen2_moe_shared": dict(model_type="qwen2_moe", num_experts=4, moe_intermediate_size=32, intermediate_size=80,
                             shared_expert_intermediate_size=48, norm_topk_prob=False, **_MOE),
})
