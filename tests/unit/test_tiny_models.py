from transformers import AutoModelForCausalLM, AutoTokenizer


def test_tiny_models_load_and_share_smollm2_vocab(tiny_llama_dir, tiny_qwen2_dir, smollm2_dir):
    reference = AutoTokenizer.from_pretrained(smollm2_dir)
    for path in (tiny_llama_dir, tiny_qwen2_dir):
        model = AutoModelForCausalLM.from_pretrained(path)
        tokenizer = AutoTokenizer.from_pretrained(path)
        assert model.config.num_hidden_layers == 2 and model.config.hidden_size == 64
        assert tokenizer.encode("<search> who </search>") == reference.encode("<search> who </search>")
