"""SpecForge 0.2.0's own offline EAGLE-3 training step, for the tests' subprocesses to import (tests/unit/
test_trainer_teachers.py on files, tests/e2e/test_live.py on the live dataset): the run config the
extraction CLI writes (its load_config, with sdpa attention and ttt_length 2), its draft config resolved
for it, its draft and training model (OnlineEagle3Model and the TargetHead, by the EAGLE-3 providers),
Eagle3TrainStrategy.forward_loss on one item (SpecForge's offline reader's item) per batch, AdamW with its
gradient clip. CPU by configuration only; it runs in a process of its own since Triton reads the
environment at import: TRITON_INTERPRET=1 (its Triton loss), TORCHDYNAMO_DISABLE=1, no FSDP wrap
(helpers.trainer_env). Imports SpecForge: the readers' folder (requirements/readers.txt) must be on the
path."""
import torch
from specforge.algorithms.eagle3 import providers
from specforge.config.schema import load_config
from specforge.runtime.contracts import TrainBatch
from specforge.training.model_loading import resolve_draft_config

ITEM_KEYS = ("input_ids", "attention_mask", "loss_mask", "hidden_state", "target")


class Eagle3Training:
    def __init__(self, run_config: str):
        self.cfg = cfg = load_config(run_config, ["training.attention_backend=sdpa", "training.ttt_length=2"])
        reg = providers.algorithm_providers()
        draft_config = resolve_draft_config(cfg, provider=reg.model.draft_config)
        draft_config.draft_vocab_size = draft_config.vocab_size  # its default, 32000, exceeds the tiny vocabulary
        torch.manual_seed(0)
        draft = reg.model.build_draft(cfg, draft_config)
        self.parts = reg.model.build_training_model(cfg, draft, draft_config, None, None)
        self.step = providers.build_step(self.parts.model, target_head=self.parts.target_head,
                                         **providers.step_options(cfg))
        self.opt = torch.optim.AdamW([p for p in self.parts.model.parameters() if p.requires_grad], lr=1e-3)

    def train_step(self, j: int, item: dict) -> float:
        """One optimizer step on one item (its sample id j); the loss."""
        batch = TrainBatch(sample_ids=[str(j)], strategy="eagle3", metadata={"target_repr": "hidden_state"},
                           tensors={k: item[k] for k in ITEM_KEYS})
        loss = self.step.forward_loss(batch).loss
        self.opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.parts.model.parameters(), self.cfg.training.max_grad_norm)
        self.opt.step()
        return loss.item()

    def epochs(self, n: int, items) -> list:
        """n epochs over items(epoch) (an iterable of items, in order); the summed loss of each epoch."""
        return [sum(self.train_step(j, item) for j, item in enumerate(items(epoch))) for epoch in range(n)]
