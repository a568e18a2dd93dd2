import pytest

import anchorkv


def test_model_compressed_size_is_the_sum_of_layers():
    fractions = [0.3, 0.2, 0.1]
    total = anchorkv.model_compressed_size(3, 4096, 8, 128, num_q_heads=32, retain_fractions=fractions)
    layers = [anchorkv.compressed_size(4096, 8, 128, num_q_heads=32, retain_fraction=f) for f in fractions]
    assert total == sum(layers)
    assert anchorkv.model_compressed_size(2, 4096, 8, 128, retain_fraction=0.2) == \
        2 * anchorkv.compressed_size(4096, 8, 128, retain_fraction=0.2)
    with pytest.raises(anchorkv.InvalidArgumentError):
        anchorkv.model_compressed_size(3, 4096, 8, 128, retain_fractions=[0.2])
    with pytest.raises(anchorkv.BudgetError, match="layer 1"):
        anchorkv.model_compressed_size(2, 4096, 8, 128, retain_fractions=[0.2, 0.001])
