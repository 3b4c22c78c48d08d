import importlib.util

import pytest
import torch

from memfit.config import ModelConfig
from memfit.errors import MissingPackageError
from memfit.models.loading import build_model
from memfit.strategies.attention import attention_implementation


def _loss_and_grad(attention: str):
    torch.manual_seed(0)
    model = build_model(ModelConfig(name="memfit/tiny-llama", init="random"), attention=attention)
    assert model.config._attn_implementation == attention_implementation(attention)
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 30:] = 0  # right padding in the second row
    loss = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
    loss.backward()
    return loss.detach(), model.model.layers[0].self_attn.q_proj.weight.grad


def test_eager_and_sdpa_compute_the_same_thing():
    eager_loss, eager_grad = _loss_and_grad("eager")
    sdpa_loss, sdpa_grad = _loss_and_grad("sdpa")
    torch.testing.assert_close(sdpa_loss, eager_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sdpa_grad, eager_grad, rtol=1e-4, atol=1e-6)


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None, reason="flash-attn is installed")
def test_flash_without_the_package_names_it():
    with pytest.raises(MissingPackageError, match="flash-attn"):
        attention_implementation("flash")
