"""HuggingFace interop internals; the public API is `tx_jax.hf`.

rules.py           invertible tensor rules and the config.json reader
architecture.py    what one HF architecture provides (config in/out, rules, tied copies)
decoders.py        GPT2LMHeadModel, LlamaForCausalLM
bert.py            BertModel, BertForMaskedLM, BertForSequenceClassification
t5.py              T5ForConditionalGeneration (v1.0 and v1.1)
safetensors_io.py  model.safetensors / sharded index in and out
"""
