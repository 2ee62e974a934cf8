"""Opening the token store for a later stage: complete, made with this tokenizer, and made for this config.

The teacher pass, the student's data and the tune worker's rows read the store tokenise wrote; they all ask
the same question here, with one answer and one set of messages (docs/run-root.md has the store's layout).
"""

from __future__ import annotations

from dataclasses import dataclass

from kdflow.schemas.commits import StageComplete, read_complete, stage_dir
from kdflow.schemas.errors import FingerprintMismatch, StoreError
from kdflow.schemas.storage import RunRoot


@dataclass(frozen=True)
class TokenStore:
    """A complete token store made for this config and tokenizer."""

    path: str  # the store's folder in the run root
    complete: StageComplete  # its _complete.json
    tokenizer_fingerprint: str

    @property
    def fingerprint(self) -> str:
        return self.complete.fingerprint

    @property
    def shards(self) -> int:
        return self.complete.shards


def check_store_tokenizer(store_tokenizer_fp: str | None, tokenizer_fp: str, store: str) -> None:
    """The token store must have been made with the tokenizer this config names (the teacher's by default)."""
    if store_tokenizer_fp is None:
        raise FingerprintMismatch(f"token store {store} does not record its tokenizer fingerprint")
    if store_tokenizer_fp != tokenizer_fp:
        raise FingerprintMismatch(
            f"token store {store} was made with tokenizer fingerprint {store_tokenizer_fp}, but this config's "
            f"tokenizer is {tokenizer_fp}; rerun tokenise with the teacher's tokenizer"
        )


def open_token_store(run_root: RunRoot, tokenizer_fp: str, expected: str) -> TokenStore:
    """The token store, if it is complete, was made with the tokenizer of fingerprint `tokenizer_fp` and from this
    config's dataset, seq_len and shard size (`expected`: the tokens fingerprint they give, with `tokenizer_fp`);
    else a StoreError that says to run tokenise."""
    store = stage_dir(run_root, "tokens")
    shown = run_root.display(store)
    done = read_complete(run_root, store)
    if done is None:
        raise StoreError(f"token store {shown} is not complete; run tokenise first")
    check_store_tokenizer(done.extra.tokenizer_fingerprint, tokenizer_fp, shown)
    # An imported store's rows come from a capture, not from `dataset:` (its fingerprint names the import's config):
    # training on it with a config whose dataset section differs was refused, with advice that could not be taken.
    if done.fingerprint != expected and not getattr(done.extra, "imported_from", None):
        raise StoreError(f"token store {shown} (fingerprint {done.fingerprint}) was made from another dataset, "
                         f"seq_len or shard size than this config ({expected}); run tokenise first")
    return TokenStore(store, done, tokenizer_fp)
