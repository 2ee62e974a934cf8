"""A MoE teacher's body variants (kdflow/tasks/teacher/body_variants.py): each experts implementation and the
compiled body against eager on a tiny Qwen3-MoE teacher (in 16/32 bits and with its experts in 4-bit), the
setting the pass takes (`precompute.experts`) and records, `kdflow bench body`, and the one-line errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kdflow.schemas.config import TeacherConfig
from kdflow.schemas.errors import ConfigError
from kdflow.tasks.common.teacher_loading import load_teacher
from kdflow.tasks.teacher.body_variants import (EXPERTS, VARIANTS, experts_in_use, measure_body_variants,
                                                pass_settings, use_experts)

pytestmark = pytest.mark.unit


def moe(folder: Path, four_bit: bool = False) -> torch.nn.Module:
    if four_bit:
        pytest.importorskip("bitsandbytes")
    return load_teacher(TeacherConfig(model=str(folder), device="cpu", dtype="float32" if not four_bit else "bfloat16",
                                      load_in_4bit=four_bit))


@pytest.mark.parametrize("four_bit", [False, True])
# transformers' experts code calls an lru_cache-wrapped version check, which dynamo traces through (and says so)
@pytest.mark.filterwarnings("ignore:Dynamo detected a call to a .functools.lru_cache.-wrapped:UserWarning")
def test_every_variant_computes_eagers_hidden_states(tiny_moe_teacher_dir: Path, four_bit: bool) -> None:
    model = moe(tiny_moe_teacher_dir, four_bit)
    before = experts_in_use(model)
    ids = torch.randint(2, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    variants = VARIANTS if not four_bit else (*EXPERTS, "compiled")  # compiled_fused: at full precision (slow)
    found = {r["variant"]: r for r in measure_body_variants(model, ids, variants, repeats=1,
                                                              compile_backend="aot_eager")}
    assert set(found) == set(variants) and not [r for r in found.values() if "error" in r], found
    tolerance = 1e-5 if not four_bit else 2e-2  # float32; bf16 sums in another order
    for name, record in found.items():
        assert record["tokens"] == 24 and record["tokens_per_s"] > 0
        assert record["max_rel_diff"] <= tolerance, record
        assert record["experts"] == pass_settings(name)["experts"]
    assert found["eager"]["max_abs_diff"] == 0.0
    assert experts_in_use(model) == before  # restored
    assert found["compiled"]["graph_breaks"] == 0, found["compiled"]  # one graph (4-bit: the cache hooks trace)


def test_a_compiled_body_that_breaks_into_graphs_says_so(tiny_teacher_dir: Path,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    """`models.body_runner`'s first call records what torch.compile made of the body and logs a graph break: the
    body then runs as several graphs, slower, and CUDA graphs cover only their parts."""
    from kdflow.tasks.common.models import body_runner

    model = load_teacher(TeacherConfig(model=str(tiny_teacher_dir), device="cpu", dtype="float32"))
    ids = torch.randint(2, 300, (2, 8), generator=torch.Generator().manual_seed(3))
    torch._dynamo.reset()  # a compile another test made of the same code would be reused, its breaks uncounted
    whole = body_runner(model, compiled=True, backend="aot_eager")
    whole(ids)
    assert whole.compile_stats["graph_breaks"] == 0 and whole.compile_stats["graphs"] >= 1
    model.model.layers[0].register_forward_hook(lambda *args: torch._dynamo.graph_break())
    torch._dynamo.reset()
    broken = body_runner(model, compiled=True, backend="aot_eager")
    with caplog.at_level("WARNING", logger="kdflow"):
        broken(ids)
    assert broken.compile_stats["graph_breaks"] >= 1 and broken.compile_stats["graphs"] >= 2
    assert "the compiled body broke into" in caplog.text


def test_a_compiled_pass_is_tuned_on_its_compiled_bodies(tiny_moe_teacher_dir: Path) -> None:
    """`kdflow tune precompute`'s experts trial (`measure_pass_experts`): with `compile_body` the implementations
    are timed inside the compiled body, as the pass runs them, and the recommendation is the winner's experts."""
    from kdflow.tasks.teacher.body_variants import COMPILED, EXPERTS_TOLERANCE, fastest_correct, measure_pass_experts

    model = moe(tiny_moe_teacher_dir)
    ids = torch.randint(2, 300, (2, 12), generator=torch.Generator().manual_seed(2))
    for compile_body, timed in ((True, tuple(COMPILED)), (False, EXPERTS)):
        records, chosen = measure_pass_experts(model, ids, compile_body, repeats=1, compile_backend="aot_eager")
        assert tuple(r["variant"] for r in records) == timed and not [r for r in records if "error" in r], records
        best = fastest_correct(records, EXPERTS_TOLERANCE, compiled=compile_body)
        assert chosen == pass_settings(best)["experts"] and chosen in EXPERTS


def test_the_fused_experts_are_timed_in_each_tiling_given_and_written_only_in_the_devices(
        tiny_moe_teacher_dir: Path) -> None:
    """`moe_tilings`: kdflow_fused once more in each (through the interpreter here), each record naming its tiling;
    the pass runs the device's, so only that record can make it the fastest correct implementation."""
    pytest.importorskip("triton")
    from kdflow.bench.gpu_report import variant_label
    from kdflow.tasks.teacher.body_variants import fastest_correct
    from kdflow.tasks.teacher.fused_moe import HOPPER, SMALL
    from kdflow.tasks.teacher.gemm_tiles import GemmTiles

    model = moe(tiny_moe_teacher_dir)
    ids = torch.randint(2, 300, (2, 12), generator=torch.Generator().manual_seed(1))
    tilings = [GemmTiles.parse("32x64x16:2:4"), HOPPER]
    records = list(measure_body_variants(model, ids, ("eager", "kdflow_fused"), repeats=1, moe_tilings=tilings))
    fused = [r for r in records if r["variant"] == "kdflow_fused"]
    assert [(r["moe_tiles"], r["moe_tiles_default"]) for r in fused] == [
        (str(SMALL), True), ("32x64x16:2:4", False), (str(HOPPER), False)]  # 24 tokens: few slots an expert
    assert all(r["max_rel_diff"] <= 1e-5 for r in fused), fused  # float32
    assert [variant_label(r) for r in fused] == ["kdflow_fused", "kdflow_fused 32x64x16:2:4",
                                                 f"kdflow_fused {HOPPER}"]
    runs = [{"variant": "grouped_mm", "tokens_per_s": 20.0, "max_rel_diff": 1e-3},
            {"variant": "kdflow_fused", "tokens_per_s": 15.0, "max_rel_diff": 1e-3, "moe_tiles_default": True},
            {"variant": "kdflow_fused", "tokens_per_s": 50.0, "max_rel_diff": 1e-3, "moe_tiles_default": False}]
    assert fastest_correct(runs, 0.02) == "grouped_mm"
    runs[1]["tokens_per_s"] = 25.0
    assert fastest_correct(runs, 0.02) == "kdflow_fused"


def test_the_setting_on_a_dense_teacher_means_nothing_and_a_bad_one_is_one_line(tiny_teacher_dir: Path,
                                                                                  tiny_moe_teacher_dir: Path) -> None:
    dense = load_teacher(TeacherConfig(model=str(tiny_teacher_dir), device="cpu", dtype="float32"))
    assert use_experts(dense, "eager") is None and experts_in_use(dense) is None
    with pytest.raises(ValueError, match="has no experts"):
        list(measure_body_variants(dense, torch.zeros(1, 4, dtype=torch.long)))
    model = moe(tiny_moe_teacher_dir)
    assert use_experts(model, "auto") == "grouped_mm"  # transformers' default, where torch has grouped matmuls
    assert use_experts(model, "batched_mm") == "batched_mm"
    with pytest.raises(ConfigError) as error:
        use_experts(model, "no_such_kernel")
    assert str(error.value).startswith("precompute.experts: no_such_kernel cannot run this teacher")
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="unknown body variants"):
        list(measure_body_variants(model, torch.zeros(1, 4, dtype=torch.long), ("fastest",)))


def test_the_pass_runs_the_chosen_experts_and_its_shards_say_which(tiny_moe_teacher_dir: Path, corpus_file: Path,
                                                                   tmp_path: Path) -> None:
    from support.tiny import tiny_config

    from kdflow.schemas.commits import list_commits, stage_dir
    from kdflow.schemas.stage_settings import materialise_settings, open_run_root, teacher_pass_settings
    from kdflow.schemas.stage_settings import tokenise_settings
    from kdflow.tasks.common.tokenizer import load_tokenizer
    from kdflow.tasks.corpus.materialise import materialise
    from kdflow.tasks.corpus.tokenise import tokenise
    from kdflow.tasks.teacher.precompute import precompute_shards

    written = {}
    for choice in ("auto", "eager"):
        config = tiny_config(tmp_path / f"run-{choice}", tiny_moe_teacher_dir, corpus_file,
                             dataset__max_documents=12, precompute__experts=choice)
        run_root = open_run_root(config)
        materialise(run_root, materialise_settings(config), None)
        tokenise(run_root, tokenise_settings(config), load_tokenizer(config.teacher, config.tokenizer))
        tag = precompute_shards(run_root, teacher_pass_settings(config))["tag"]
        records = list_commits(run_root, stage_dir(run_root, "topk", tag), "topk", tag)
        written[choice] = {record.extra.experts for record in records.values()}
    assert written == {"auto": {"grouped_mm"}, "eager": {"eager"}}


def test_the_bench_prints_one_line_per_variant(tiny_moe_teacher_dir: Path, corpus_file: Path, tmp_path: Path) -> None:
    from support.tiny import tiny_config

    from kdflow.bench.body import build_parser, records
    from kdflow.schemas.config_io import dump_config

    path = tmp_path / "moe.yaml"
    path.write_text(dump_config(tiny_config(tmp_path / "run", tiny_moe_teacher_dir, corpus_file,
                                            teacher__dtype="float32")))
    args = build_parser().parse_args(["--config", str(path), "--micro-batch", "2", "--seq-len", "8", "--repeats", "1",
                                      "--variants", "eager,batched_mm", "--device", "cpu"])
    found = list(records(args))
    assert [r["variant"] for r in found] == ["eager", "batched_mm"]
    assert all(r["bench"] == "body" and r["micro_batch"] == 2 and r["seq_len"] == 8 and r["layers"] == 2
               for r in found)


def test_write_sets_the_fastest_correct_implementation_in_the_config(tiny_moe_teacher_dir: Path, corpus_file: Path,
                                                                     tmp_path: Path) -> None:
    from support.tiny import tiny_config

    from kdflow.bench.body import main
    from kdflow.schemas.config_io import dump_config, load_config
    from kdflow.tasks.teacher.body_variants import fastest_correct
    from kdflow.tasks.teacher.tune_file import write_precompute_settings

    runs = [{"variant": "eager", "tokens_per_s": 10.0, "max_rel_diff": 0.0},
            {"variant": "batched_mm", "tokens_per_s": 30.0, "max_rel_diff": 0.5},  # fast and wrong
            {"variant": "grouped_mm", "tokens_per_s": 20.0, "max_rel_diff": 1e-3},
            {"variant": "compiled", "tokens_per_s": 40.0, "max_rel_diff": 0.0},  # not something the pass runs
            {"variant": "kdflow_fused", "skipped": "runs on CUDA, not cpu"}]
    assert fastest_correct(runs, 0.02) == "grouped_mm" and fastest_correct(runs[1:2], 0.02) is None
    assert fastest_correct(runs, 0.02, compiled=True) == "compiled"  # where the pass can compile it as timed
    assert pass_settings("compiled") == {"experts": "grouped_mm", "compile_body": True}
    assert pass_settings("compiled_fused") == {"experts": "kdflow_fused", "compile_body": True}
    assert pass_settings("eager") == {"experts": "eager", "compile_body": False}
    path = tmp_path / "moe.yaml"
    path.write_text("# my teacher\n" + dump_config(tiny_config(tmp_path / "run", tiny_moe_teacher_dir, corpus_file,
                                                              teacher__dtype="float32")))
    assert main(["--config", str(path), "--micro-batch", "2", "--seq-len", "8", "--repeats", "1", "--device", "cpu",
                 "--variants", "eager,batched_mm", "--write"]) == 0
    assert load_config(path).precompute.experts in ("eager", "batched_mm")
    assert load_config(path).precompute.compile_body is False
    assert path.read_text().startswith("# my teacher\n")
    with pytest.raises(SystemExit, match="no variant ran within 0.02 of eager: nothing written"):
        main(["--config", str(path), "--micro-batch", "2", "--seq-len", "8", "--repeats", "1", "--device", "cpu",
              "--variants", "compiled", "--compile-backend", "aot_eager", "--write"])  # not as the pass compiles
    write_precompute_settings(path, pass_settings("compiled"))  # what --write does when `compiled` is the fastest
    written = load_config(path).precompute
    assert (written.experts, written.compile_body) == ("grouped_mm", True)
