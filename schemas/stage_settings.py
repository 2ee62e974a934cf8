"""What each stage reads of the config, in one place: a small frozen view per stage, and the run root opened.

A stage entry takes the run root and its own view, so what it depends on is its signature. Reads across
sections are resolved here: tokenise's shard size is `precompute.sequences_per_shard` (token and top-K shards
have the same rows), the student's data takes the teacher's K. Fingerprints keep reading the config (their
values name stores already written), so a view carries the fingerprints its stage needs, computed here.
"""

from __future__ import annotations

from dataclasses import dataclass

from kdflow.schemas.config import DatasetConfig, KDFlowConfig, PrecomputeConfig, StudentConfig, TeacherConfig
from kdflow.schemas.config_io import dump_config
from kdflow.schemas.fingerprints import corpus_fingerprint, tokens_fingerprint_of, topk_fingerprint_of
from kdflow.schemas.storage import RunRoot


def open_run_root(config: KDFlowConfig) -> RunRoot:
    """The run root a config names: opened once by each flow, worker or command, and passed down."""
    return RunRoot(config.run_root)


@dataclass(frozen=True)
class MaterialiseSettings:
    dataset: DatasetConfig
    corpus_fingerprint: str


def materialise_settings(config: KDFlowConfig) -> MaterialiseSettings:
    return MaterialiseSettings(config.dataset, corpus_fingerprint(config))


@dataclass(frozen=True)
class TokeniseSettings:
    seq_len: int
    sequences_per_shard: int  # precompute.sequences_per_shard: a top-K shard holds the rows of one token shard
    corpus_fingerprint: str


def tokenise_settings(config: KDFlowConfig) -> TokeniseSettings:
    return TokeniseSettings(config.seq_len, config.precompute.sequences_per_shard, corpus_fingerprint(config))


@dataclass(frozen=True)
class StudentDataSettings:
    seq_len: int
    top_k: int  # precompute.top_k: what every top-K shard must hold
    eval_shards: int
    eval_sequences: int
    seed: int


def student_data_settings(config: KDFlowConfig) -> StudentDataSettings:
    student = config.student
    return StudentDataSettings(config.seq_len, config.precompute.top_k, student.eval_shards, student.eval_sequences,
                               student.seed)


@dataclass(frozen=True)
class TeacherPassSettings:
    """What the teacher pass, its micro-batch tuning and the logit import read. The store's tag also hashes the
    teacher's fingerprint, known only once the device is (and an import's, once its rows are digested): the
    fingerprints are computed by the methods below from what the view holds."""

    teacher: TeacherConfig
    tokenizer: str | None  # the config's `tokenizer`; None: the teacher's own
    precompute: PrecomputeConfig
    seq_len: int
    corpus_fingerprint: str
    resolved_config: str  # dump_config(config): kept beside the store (`config.yaml`), what made it

    def tokens_fingerprint(self, tokenizer_fp: str) -> str:
        """The fingerprint of the token store this pass reads, made with the tokenizer of `tokenizer_fp`."""
        return tokens_fingerprint_of(self.corpus_fingerprint, tokenizer_fp, self.seq_len,
                                     self.precompute.sequences_per_shard)

    def topk_fingerprint(self, teacher_fp: str, tokens_fp: str) -> str:
        """The top-K store's TAG (topk_fingerprint)."""
        return topk_fingerprint_of(teacher_fp, tokens_fp, self.precompute)


def teacher_pass_settings(config: KDFlowConfig) -> TeacherPassSettings:
    return TeacherPassSettings(config.teacher, config.tokenizer, config.precompute, config.seq_len,
                               corpus_fingerprint(config), dump_config(config))


@dataclass(frozen=True)
class TrainingSettings:
    """What training reads. The teacher section: the held-out full KL loads it, the top-K store is found by it
    and the model card names it (with the dataset). The token and top-K stores' fingerprints need the tokenizer's
    and the teacher's, known only once they are loaded: the methods below compute them from what the view holds."""

    student: StudentConfig
    data: StudentDataSettings
    teacher: TeacherConfig
    tokenizer: str | None  # the config's `tokenizer`; None: the teacher's own
    precompute: PrecomputeConfig  # K and the store format the top-K store must have been made with
    dataset: DatasetConfig  # named on the model card
    corpus_fingerprint: str
    resolved_config: str  # dump_config(config): kept beside the student (`config.yaml`), what it trains with

    @property
    def seq_len(self) -> int:
        return self.data.seq_len

    def tokens_fingerprint(self, tokenizer_fp: str) -> str:
        """The fingerprint of the token store training reads, made with the tokenizer of `tokenizer_fp`."""
        return tokens_fingerprint_of(self.corpus_fingerprint, tokenizer_fp, self.data.seq_len,
                                     self.precompute.sequences_per_shard)

    def topk_fingerprint(self, teacher_fp: str, tokens_fp: str) -> str:
        """The TAG of the top-K store precompute makes for this teacher and token store (topk_fingerprint)."""
        return topk_fingerprint_of(teacher_fp, tokens_fp, self.precompute)


def training_settings(config: KDFlowConfig) -> TrainingSettings:
    return TrainingSettings(config.student, student_data_settings(config), config.teacher, config.tokenizer,
                            config.precompute, config.dataset, corpus_fingerprint(config), dump_config(config))


def held_out_problem(eval_shards: int, shards: int, sequences: int) -> str | None:
    """Why `student.eval_shards` leaves nothing to train on in a token store of `shards` shards, or None. Training
    refuses such a store; a pipeline says so right after tokenise, before the teacher pass."""
    if not sequences:
        return ("the token store holds no sequence: the corpus gave fewer tokens than one sequence of seq_len (the "
                "remainder after the last whole sequence is left out); lower seq_len, or add documents and run in a "
                "new run_root (this one's stores were made from the corpus as it is)")
    if eval_shards < shards:
        return None
    shard_s, sequence_s = "" if shards == 1 else "s", "" if sequences == 1 else "s"
    smaller = (" or precompute.sequences_per_shard (more, smaller shards; tokenise again)" if sequences > 1
               else "; with one sequence, a held-out one leaves none to train on")
    return (f"student.eval_shards={eval_shards} leaves no training shard: the token store has {shards} "
            f"shard{shard_s} ({sequences:,} sequence{sequence_s}); lower student.eval_shards (0: no held-out "
            f"evaluation){smaller}")
