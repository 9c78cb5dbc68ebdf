"""HF-format checkpoint directories (config.json + *.safetensors): the loader, what it reads, and one module per
architecture family.

The loader and what every family shares:

- ``loader``: an HF directory -> ``Decoder`` (``load_hf_directory``); ``ARCHITECTURES``, every family module
  registered against the contract in ``workbench.loading.family``
- ``config``: ``HFConfig``, config.json read field by field, errors naming the field and the file
- ``checkpoint``: ``SafetensorsCheckpoint``, the tensors of one file or of shards with an index
- ``tokenizer``: the directory's tokenizer.json plus the special tokens it does not state
- ``parts``: checkpoint readers the older dense families share (norms, linear maps, fused QKV split per group)
- ``experts``: mixture-of-experts layers, their router values and expert tensors in every spelling

The family modules, each declaring ``FAMILIES = (Family(...),)``:

- ``gpt2``: GPT-2
- ``llama``: Llama 1-3, Mistral, Mixtral, Qwen2/3 (and their MoEs), gpt-oss, SmolLM3, OLMo, OLMo 2; its
  ``Variant`` table is read by ``modern`` and ``moe_families`` too; ``llama_layers`` holds its
  sliding-window and NoPE rules per layer
- ``modern``: Granite, Helium, Ministral, Seed-OSS, OLMo 3, EXAONE 4, HunYuan, ERNIE 4.5, GLM, Cohere, Arcee,
  Nemotron, Apertus, InternLM3 (rows of ``llama.Variant``)
- ``moe_families``: OLMoE, MiniMax-M2, GLM-4.5, dots.llm1, ERNIE 4.5 MoE, HunYuan MoE, Phi-3.5-MoE, GraniteMoE
- ``neox``: GPT-NeoX / Pythia, GPT-J, GPT-Neo
- ``gemma``: Gemma, Gemma 2, Gemma 3 (text)
- ``phi``: Phi-1/1.5/2, Phi-3, StableLM
- ``opt_bloom``: OPT and BLOOM
- ``deepseek``: DeepSeek-V2 and V3 (latent attention, routed and shared experts)
- ``minicpm3``: MiniCPM3 (``deepseek``'s latent attention)
- ``llama4``: Llama 4's text decoder
- ``dbrx``: DBRX
- ``diffllama``: DiffLlama (differential attention)
- ``falcon``, ``starcoder``, ``mpt``, ``codegen``, ``xglm``, ``openai_gpt``: the older dense families
"""
