"""Classify scikit-learn's bundled 8x8 digits with tiegrad's ``MLPClassifier``.

Needs the ``examples`` extra (``pip install 'tiegrad[examples]'``); the data ships
with scikit-learn, so nothing is downloaded. Run ``python examples/digits.py``; it
prints the test accuracy (about 97-98%).
"""

from __future__ import annotations

import argparse

import numpy as np
from sklearn.datasets import load_digits

from tiegrad.data import ArrayDataset, DataLoader
from tiegrad.models import MLPClassifier
from tiegrad.optim import AdamW
from tiegrad.optim.schedules import CosineWarmup
from tiegrad.train import Trainer


def main(epochs: int = 30, seed: int = 0, progress: bool = True) -> float:
    """Train on 75% of the digits, return (and print) the accuracy on the other 25%."""
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    train, test = ArrayDataset(x, y).split(0.25, np.random.default_rng(seed))
    model = MLPClassifier(64, [128, 64], 10, dropout=0.1, seed=seed)
    optimizer = AdamW(model.parameters(), lr=3e-3, weight_decay=1e-3)
    loader = DataLoader(train, batch_size=64)
    steps = epochs * len(loader)
    schedule = CosineWarmup(optimizer, warmup_steps=steps // 20, total_steps=steps)
    trainer = Trainer(
        model,
        optimizer,
        None,
        loader,
        DataLoader(test, batch_size=256, shuffle=False),
        schedule,
        epochs=epochs,
        eval_every=len(loader) * 5,
        seed=seed,
        progress=progress,
    )
    result = trainer.fit()
    x_test, y_test = test.arrays
    accuracy = float(np.mean(model.predict(x_test) == y_test))
    print(
        f"digits: {len(train)} train / {len(test)} test images, {result.step} steps, "
        f"test loss {result.val_loss:.4f}, test accuracy {accuracy:.2%}"
    )
    return accuracy


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args()
    main(args.epochs, args.seed, not args.no_progress)
