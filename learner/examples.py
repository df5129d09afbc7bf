"""Example ``--model-entry``: a byte-level MLP language model that you can copy and adapt.

    ddiloco local --model-entry ddiloco.learner.examples:char_mlp
    task = build_task(model_entry="ddiloco.learner.examples:char_mlp", num_learners=2)

``char_mlp`` follows the contract in ``ddiloco.learner.task``: called with ``learner_index``,
``num_learners``, ``seed`` and ``device``, it returns a ``Task``. The model predicts each byte from
the ``context`` bytes before it (Bengio et al. 2003, as in karpathy's makemore), on the same
stdlib corpus, split and sharded the same way as the built-in GPT task.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from ddiloco.learner.data import BatchIterator, eval_loss, load_tokens, shard, split_eval
from ddiloco.learner.task import Task, embedding_param_names, gpt_loss


class CharMLP(nn.Module):
    """Next-byte model over a fixed window: embed the last ``context`` bytes, concatenate, MLP.

    Follows ``GPT.forward``'s contract, ``model(idx, targets) -> (logits, loss)``, so the
    built-in ``gpt_loss`` and ``data.eval_loss`` work with it unchanged.
    """

    def __init__(
        self, vocab_size: int = 256, context: int = 8, n_embd: int = 16, hidden: int = 128
    ):
        super().__init__()
        self.vocab_size = vocab_size
        self.context = context
        self.emb = nn.Embedding(vocab_size, n_embd)
        self.hidden = nn.Linear(context * n_embd, hidden)
        self.out = nn.Linear(hidden, vocab_size)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        B, T = idx.shape
        e = self.emb(idx)  # (B, T, n_embd)
        # Position t sees bytes t-context+1 .. t; before the start of the window it sees zeros.
        padded = F.pad(e, (0, 0, self.context - 1, 0))
        window = torch.cat([padded[:, i : i + T] for i in range(self.context)], dim=-1)
        logits = self.out(torch.tanh(self.hidden(window)))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.float().view(B * T, -1), targets.reshape(B * T))
        return logits, loss


def char_mlp(*, learner_index: int, num_learners: int, seed: int, device: str) -> Task:
    """The example entry: a ``CharMLP`` on the stdlib corpus, shard ``learner_index``."""
    batch_size, block_size = 16, 32
    torch.manual_seed(seed)  # identical initial model on every learner
    model = CharMLP().to(device)
    train, held_out = split_eval(load_tokens(None))
    return Task(
        model=model,
        batches=BatchIterator(
            shard(train, learner_index, num_learners),
            batch_size,
            block_size,
            seed=seed + learner_index,
            device=device,
        ),
        loss_fn=gpt_loss,
        eval_loss=functools.partial(
            eval_loss, tokens=held_out, batch_size=batch_size, block_size=block_size, device=device
        ),
        tokens_per_batch=batch_size * block_size,
        embedding_params=embedding_param_names(model),
    )
