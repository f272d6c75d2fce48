"""Client training script (NVFlare Client API): a small MLP on scikit-learn's digits, one shard per site.

Each round the site receives the global model, trains ``--epochs`` local epochs on its shard and sends its
weights back; NVFlare turns them into a ``WEIGHT_DIFF`` DXO (the job sets ``params_transfer_type=DIFF``), which
is what the gpu_codec filters compress. Runs as ``python digits_client.py`` inside an NVFlare job only.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from sklearn.datasets import load_digits

TEST_SHARE = 0.25


class DigitsNet(torch.nn.Module):
    """64 pixels -> 256 hidden units -> 10 classes (19,466 parameters)."""

    def __init__(self, hidden: int = 256) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(64, hidden)
        self.fc2 = torch.nn.Linear(hidden, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def make_model() -> torch.nn.Module:
    return DigitsNet()


def load_split(site_index: int | None, n_sites: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The training shard of site ``site_index`` (0-based), or the common test set when ``site_index`` is None."""
    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(y))
    x, y = (x[order] / 16.0).astype(np.float32), y[order].astype(np.int64)
    n_test = int(len(y) * TEST_SHARE)
    if site_index is None:
        sel = slice(0, n_test)
    else:
        sel = slice(n_test + site_index, None, n_sites)
    return torch.from_numpy(x[sel]), torch.from_numpy(y[sel])


def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def train(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, epochs: int, seed: int) -> int:
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    steps = 0
    for _ in range(epochs):
        for idx in torch.randperm(len(y), generator=gen).split(32):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
            steps += 1
    return steps


def main() -> None:
    import nvflare.client as flare
    from nvflare.app_common.abstract.fl_model import FLModel

    ap = argparse.ArgumentParser()
    ap.add_argument("--n-sites", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=2)
    args = ap.parse_args()

    torch.set_num_threads(1)
    flare.init()
    site = flare.get_site_name()
    index = (int(site.rsplit("-", 1)[-1]) - 1) % args.n_sites
    x, y = load_split(index, args.n_sites)
    x_test, y_test = load_split(None, args.n_sites)
    model = make_model()
    while flare.is_running():
        received = flare.receive()
        model.load_state_dict({k: torch.as_tensor(v) for k, v in received.params.items()})
        global_acc = accuracy(model, x_test, y_test)
        steps = train(model, x, y, args.epochs, seed=1000 * index + received.current_round)
        flare.send(
            FLModel(
                params={k: v.detach().clone() for k, v in model.state_dict().items()},
                metrics={"accuracy": global_acc},
                meta={"NUM_STEPS_CURRENT_ROUND": steps},
            )
        )


if __name__ == "__main__":
    main()
