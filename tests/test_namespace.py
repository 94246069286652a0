"""The subpackages are reachable from ``import tiegrad``, as ``torch.nn`` is from ``torch``."""

import tiegrad as tg


def test_subpackages_are_attributes_of_the_package():
    assert tg.nn.Linear and tg.optim.AdamW and tg.models.TiedLM
    assert tg.data.TextDataset and tg.train.Trainer and tg.ops.softmax
    assert tg.save and tg.load and tg.inspect
