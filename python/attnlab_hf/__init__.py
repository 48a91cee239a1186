"""attnlab's architectures for Hugging Face transformers (the remote code `attnlab export` copies into
every non-vanilla export; `trust_remote_code=True` loads it from there). One file per family
(attnlab_gpt_neox, attnlab_llama, attnlab_olmo2) and the attention variants (attnlab_attention: vanilla,
DAR, uniform, window, sink; attnlab_linearized: STILL, LoLCATs). Files import each other relatively, as
transformers requires of remote code; this file only makes the folder a package for tests."""
