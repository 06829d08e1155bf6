"""MosaicML Composer 0.32.1 (torch 2.7) and ckptlib, both ways (issue 28.3, 28.6). Under torchrun:

composer_run.py train ROOT SAVER BATCHES   a real Trainer (FSDP2, sharded state dicts) trains BATCHES batches;
                                           SAVER=composer: Composer saves into ROOT/composer every 2 batches;
                                           SAVER=ckptlib: ckptlib.presets.composer_save.save(ROOT/ckptlib, state)
                                           at the end. Rank 0 writes the full state to ROOT/expected-SAVER.pt.
composer_run.py autoresume ROOT SAVER      Trainer(autoresume=True, save_folder=ROOT/SAVER) resumes; its state
                                           is compared with ROOT/expected-SAVER.pt, then it trains 2 more batches
composer_run.py load ROOT SAVER            a plain FSDP2 model and AdamW load ROOT/SAVER with preset="composer"
"""

from __future__ import annotations

import os
import sys
import warnings

import torch
from client_common import differences, finish, full_state, init_gloo, rank, report, world
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ckptlib
from ckptlib.presets import composer_save

warnings.filterwarnings("ignore")


def trainer(save_folder: str | None, batches: int, save_interval: str = "2ba", **kw):
    from composer import Trainer
    from composer.models import ComposerClassifier
    from composer.optim import LinearWithWarmupScheduler
    from composer.utils import dist
    from composer.utils.parallelism import FSDP2Config

    torch.manual_seed(0)
    model = ComposerClassifier(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)), num_classes=4)
    model.fsdp_wrap_fn = lambda m: isinstance(m, nn.Linear)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(64, 8, generator=g), torch.randint(0, 4, (64,), generator=g))
    return Trainer(
        model=model,
        train_dataloader=DataLoader(data, batch_size=4, sampler=dist.get_sampler(data, shuffle=True)),
        optimizers=torch.optim.AdamW(model.parameters(), lr=1e-2),
        schedulers=LinearWithWarmupScheduler(t_warmup="1ba"),
        max_duration=f"{batches}ba",
        device="cpu",
        parallelism_config={"fsdp": FSDP2Config(state_dict_type="sharded")},
        save_folder=save_folder,
        save_interval=save_interval,
        save_overwrite=True,
        run_name="tiny-run",
        progress_bar=False,
        log_to_console=False,
        loggers=[],
        seed=17,
        **kw,
    )


class Plain(nn.Module):
    """ComposerClassifier's parameters under the same names, without Composer."""

    def __init__(self):
        super().__init__()
        self.module = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def main() -> None:
    mode, root, saver = sys.argv[1], os.path.abspath(sys.argv[2]), sys.argv[3]
    expected_path = os.path.join(root, f"expected-{saver}.pt")
    if mode == "train":
        t = trainer(os.path.join(root, "composer") if saver == "composer" else None, int(sys.argv[4]))
        t.fit()
        if saver == "ckptlib":
            composer_save.save(os.path.join(root, "ckptlib"), t.state)
        expected = full_state(t.state.model, t.state.optimizers[0])
        if rank() == 0:
            torch.save(expected, expected_path)
        report(batch=int(t.state.timestamp.batch.value), world=world())
        t.close()
    elif mode == "autoresume":
        t = trainer(os.path.join(root, saver), 6, autoresume=True, save_interval="100ba")
        resumed_batch = int(t.state.timestamp.batch.value)
        state = full_state(t.state.model, t.state.optimizers[0])
        expected = torch.load(expected_path, weights_only=True)
        t.fit()
        report(
            resumed_batch=resumed_batch,
            differences=differences(expected, state),
            final_batch=int(t.state.timestamp.batch.value),
            world=world(),
        )
        t.close()
    else:
        init_gloo()
        model = Plain()
        if world() > 1:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (world(),))
            for layer in model.module:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
        optim = torch.optim.AdamW(model.parameters(), lr=1.0)
        result = ckptlib.load(os.path.join(root, saver), {"model": model, "optim": optim}, preset="composer")
        expected = torch.load(expected_path, weights_only=True)
        report(
            differences=differences(expected, full_state(model, optim)),
            step=result.step,
            uri=os.path.basename(result.uri),
            timestamp_batch=result.metadata["timestamp"]["batch"],
            run_name=result.metadata.get("run_name"),
            world=world(),
            torch=torch.__version__,
        )
        finish()


if __name__ == "__main__":
    main()
