"""What adapters.py relies on in PEFT: these fail if a PEFT release changes the internals it switches."""

import torch
from peft.tuners.tuners_utils import BaseTunerLayer

from nugget_rag.config import DECODER, ENCODER


def test_every_lora_layer_has_the_switches_and_weights_adapters_py_uses(make_model):
    model = make_model()
    assert model.adapters.layers
    for layer in model.adapters.layers:
        assert isinstance(layer, BaseTunerLayer)
        assert isinstance(vars(layer)["_active_adapter"], (list, str))
        assert isinstance(vars(layer)["_disable_adapters"], bool)
        assert DECODER in layer.lora_A and callable(layer.get_delta_weight)
        assert isinstance(layer.get_base_layer(), torch.nn.Linear)


def test_our_switch_gives_pefts_output_without_freezing_the_other_adapter(make_model, doc_ids):
    model = make_model()
    ids = torch.tensor([doc_ids("one switch for both adapters")])
    with torch.no_grad():
        ours = {}
        for adapter in (ENCODER, DECODER, None):
            model.merged_adapters = ()
            with model.use_adapter(adapter):
                ours[adapter] = model.llama(input_ids=ids).logits
        assert not torch.allclose(ours[ENCODER], ours[DECODER])
        model.peft.set_adapter(ENCODER)
        assert torch.allclose(model.llama(input_ids=ids).logits, ours[ENCODER], atol=1e-6)
        model.peft.set_adapter(DECODER)
        assert torch.allclose(model.llama(input_ids=ids).logits, ours[DECODER], atol=1e-6)
        with model.peft.disable_adapter():
            assert torch.allclose(model.llama(input_ids=ids).logits, ours[None], atol=1e-6)
    # PEFT's set_adapter froze the encoder; the switch of adapters.py never does
    assert not any(p.requires_grad for p in model.adapter_parameters(ENCODER))
    model.set_trainable()
    with model.use_adapter(DECODER):
        pass
    assert all(p.requires_grad for p in model.adapter_parameters(ENCODER))


def test_merged_weights_equal_the_adapter_pass(make_model, doc_ids):
    model = make_model()
    ids = torch.tensor([doc_ids("merged or not, the same logits")])
    with torch.no_grad():
        model.merged_adapters = ()
        with model.use_adapter(DECODER):
            plain = model.llama(input_ids=ids).logits
        model.merged_adapters = (DECODER,)
        with model.use_adapter(DECODER):
            merged = model.llama(input_ids=ids).logits
    assert torch.allclose(plain, merged, atol=1e-5)
