"""An attnlab OLMo 2 model (attnlab's src/model/llama.rs, `Family::Olmo2`) with attnlab's attention kinds:
attnlab_llama.py's model with OLMo 2's layer layout (no input norm; q_norm / k_norm over the whole
projections; norms on the attention and MLP outputs before each residual add)."""
from .attnlab_llama import AttnlabLlamaConfig, AttnlabLlamaForCausalLM


class AttnlabOlmo2Config(AttnlabLlamaConfig):
    model_type = "attnlab_olmo2"
    family = "olmo2"


class AttnlabOlmo2ForCausalLM(AttnlabLlamaForCausalLM):
    config_class = AttnlabOlmo2Config
