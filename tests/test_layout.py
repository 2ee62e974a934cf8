"""The package layout: one installed namespace, layers that import one way, and kdflow beside a user's project.

kdflow keeps the design card's folders (`schemas/`, `tasks/`, `flows/`) but installs them as `kdflow.schemas`,
`kdflow.tasks` and `kdflow.flows`; a user's own `tasks.py`, `flows/` or `schemas/` in the working folder must
never be imported by kdflow, its teacher worker or its torchrun ranks.
"""

from __future__ import annotations

import ast
import os
import sys
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.children import run
from support.modules import REPO, source_modules

from kdflow.schemas.config_io import config_from_dict, dump_config, load_config

# What each layer may import from kdflow (besides itself): contracts at the bottom, apps at the top.
ALLOWED = {
    "kdflow.schemas": ("kdflow.schemas",),
    "kdflow.tasks.common": ("kdflow.schemas", "kdflow.tasks.common"),
    "kdflow.tasks": ("kdflow.schemas", "kdflow.tasks"),  # tasks/*.py: what spans the stages (pre-flight)
    "kdflow.tasks.corpus": ("kdflow.schemas", "kdflow.tasks.common", "kdflow.tasks.corpus"),
    "kdflow.tasks.teacher": ("kdflow.schemas", "kdflow.tasks.common", "kdflow.tasks.teacher"),
    "kdflow.tasks.student": ("kdflow.schemas", "kdflow.tasks.common", "kdflow.tasks.student"),
    "kdflow.flows": ("kdflow.schemas", "kdflow.tasks", "kdflow.flows"),
    # The benchmarks measure the stages' own code and the demo's assets; never a command, a flow or the CLI.
    "kdflow.bench": ("kdflow.schemas", "kdflow.tasks", "kdflow.demo_assets", "kdflow.configs", "kdflow.bench"),
    "kdflow": ("kdflow",),
}


def kdflow_imports(path: Path, module: str, *, type_checking: bool = True) -> set[str]:
    """Every kdflow module `path` imports, at the top or inside functions (relative imports resolved);
    `type_checking=False` leaves out the imports under `if TYPE_CHECKING:`, which never run."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skipped = set() if type_checking else {id(inner) for node in ast.walk(tree) if _is_type_checking_block(node)
                                           for part in node.body for inner in ast.walk(part)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.rsplit(".", node.level - (path.name == "__init__.py"))[0]
                base = f"{package}.{base}".rstrip(".")
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names}
    return {name for name in found if name == "kdflow" or name.startswith("kdflow.")}


def _is_type_checking_block(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def layer_of(module: str) -> str:
    return max((layer for layer in ALLOWED if module == layer or module.startswith(layer + ".")), key=len)


def test_imports_run_one_way() -> None:
    wrong = []
    for module, path in source_modules().items():
        allowed = ALLOWED[layer_of(module)]
        for imported in kdflow_imports(path, module):
            if imported in source_modules() or imported.rsplit(".", 1)[0] in source_modules():
                target = imported if imported in source_modules() else imported.rsplit(".", 1)[0]
                if not any(target == a or target.startswith(a + ".") for a in allowed) and target != "kdflow":
                    wrong.append(f"{module} imports {target}")
    assert wrong == []


def test_only_the_command_line_imports_the_benchmarks() -> None:
    """`kdflow bench NAME` is the way in: besides the benchmarks themselves, only kdflow.cli imports kdflow.bench."""
    wrong = []
    for module, path in source_modules().items():
        if module in ("kdflow.cli", "kdflow.bench") or module.startswith("kdflow.bench."):
            continue
        wrong += [f"{module} imports {name}" for name in sorted(kdflow_imports(path, module))
                  if name == "kdflow.bench" or name.startswith("kdflow.bench.")]
    assert wrong == []


def import_graph() -> dict[str, set[str]]:
    """Module -> the kdflow modules it imports when it runs (inside functions too, not under TYPE_CHECKING)."""
    modules = source_modules()
    graph = {}
    for module, path in modules.items():
        names = kdflow_imports(path, module, type_checking=False)
        targets = {name if name in modules else name.rsplit(".", 1)[0] for name in names}
        graph[module] = {target for target in targets if target in modules and target != module}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each import cycle once, as the modules along it (a depth-first search that remembers the path it is on)."""
    cycles, done, path = [], set(), []

    def visit(module: str) -> None:
        path.append(module)
        for target in sorted(graph[module]):
            if target in path:
                cycles.append(path[path.index(target):] + [target])
            elif target not in done:
                visit(target)
        path.pop()
        done.add(module)

    for module in sorted(graph):
        if module not in done:
            visit(module)
    return cycles


def test_no_import_cycles() -> None:
    """kdflow's modules import one another one way: what two modules both need lives in the lower one, so no
    import is left inside a function to break a circle (a lazy import counts here; a TYPE_CHECKING one does not)."""
    assert [" -> ".join(cycle) for cycle in import_cycles(import_graph())] == []


def test_no_private_name_is_imported_from_another_module() -> None:
    """A name another module needs is public: `from kdflow.X import _name` does not appear in kdflow's code."""
    private = []
    for module, path in source_modules().items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kdflow"):
                private += [f"{module} imports {node.module}.{alias.name}" for alias in node.names
                            if alias.name.startswith("_") and not alias.name.startswith("__")]
    assert private == []


def defined_names(path: Path) -> set[str]:
    """The names a module defines at its top level (functions, classes, assignments, also under `if`/`try`)."""
    names = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        for inner in [node, *(ast.walk(node) if isinstance(node, (ast.If, ast.Try)) else ())]:
            if isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(inner.name)
            elif isinstance(inner, (ast.Assign, ast.AnnAssign)):
                targets = inner.targets if isinstance(inner, ast.Assign) else [inner.target]
                names |= {name.id for target in targets for name in ast.walk(target) if isinstance(name, ast.Name)}
    return names


def test_every_name_is_imported_from_the_module_that_defines_it() -> None:
    """No facades: `from kdflow.X import name` (in kdflow's code and the tests) names the module where `name` is
    defined, never one that imported it from elsewhere, so a reader finds a name where its import says."""
    modules = source_modules()
    defined = {module: defined_names(path) for module, path in modules.items()}
    through = []
    for path in python_files():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module in modules:
                through += [f"{path.relative_to(REPO)}:{node.lineno} {node.module}.{alias.name}" for alias in node.names
                            if alias.name not in defined[node.module] and f"{node.module}.{alias.name}" not in modules]
    assert through == []


# Where the whole KDFlowConfig may be a parameter: flows, commands and benches, the views built from it, fingerprints,
# the config's own text, pre-flight (it checks every section), the worker launch (it writes the config file) and the
# paths' spellings (the run root's stores against the dataset and init_from).
WHOLE_CONFIG = ("kdflow.flows", "kdflow.commands", "kdflow.bench", "kdflow.cli", "kdflow.demo_assets",
                "kdflow.schemas.stage_settings", "kdflow.schemas.fingerprints", "kdflow.schemas.config_io",
                "kdflow.tasks.preflight", "kdflow.tasks.preflight_stores", "kdflow.tasks.common.launch",
                "kdflow.tasks.path_spellings")


def test_stages_take_their_own_settings_not_the_whole_config() -> None:
    """One front door per stage: below flows and commands a function takes the run root and its stage's view (or the
    section it reads), never the whole config."""
    wrong = []
    for module, path in source_modules().items():
        if module.startswith(WHOLE_CONFIG):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                arguments = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
                if any(a.annotation is not None and "KDFlowConfig" in ast.unparse(a.annotation) for a in arguments):
                    wrong.append(f"{module}.{node.name}")
    assert wrong == []


@pytest.mark.usefixtures("children")
def test_no_stage_code_imports_prefect_or_torch_compile() -> None:
    """Every module of kdflow.schemas and kdflow.tasks imports without pulling Prefect in, nor torch.compile's
    tracer (torch._dynamo, ~1.8 s of CPU: a process that loads a transformers model pays it there anyway, one that
    only reads stores or imports captures need not; the compiled paths import it when they run)."""
    names = [name for name in source_modules() if name.startswith(("kdflow.schemas", "kdflow.tasks"))]
    code = ("import importlib, sys\n"
            f"for name in {names!r}:\n"
            "    importlib.import_module(name)\n"
            "print(sorted(m for m in sys.modules if m.startswith(('prefect.', 'torch._dynamo')) or m == 'prefect'))\n")
    result = run([sys.executable, "-c", code], what="importing every stage module", timeout=300, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


MAX_FILE_LINES = 350  # below the largest file the house had (420): split a file by responsibility past this


def python_files() -> list[Path]:
    """Every Python file of the repository: the four package folders, the tests and their support package."""
    return sorted({*source_modules().values(), *(REPO / "tests").rglob("*.py")})


def test_no_source_file_is_long() -> None:
    long = {str(path.relative_to(REPO)): n for path in python_files()
            if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_FILE_LINES}
    assert long == {}


def test_no_line_is_longer_than_the_configured_length() -> None:
    """The line length lives in pyproject.toml (`[tool.ruff] line-length`, which editors and ruff read too)."""
    limit = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["ruff"]["line-length"]
    long = [f"{path.relative_to(REPO)}:{number}" for path in python_files()
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if len(line) > limit]
    assert long == []


@pytest.mark.usefixtures("children")
def test_top_level_names_are_not_importable_from_a_clean_folder(tmp_path: Path) -> None:
    code = ("import importlib.util as u\n"
            "print([n for n in ('tasks', 'flows', 'schemas') if u.find_spec(n) is not None])\n"
            "import kdflow.tasks.teacher.topk, kdflow.flows, kdflow.schemas.commits\n")
    result = run([sys.executable, "-c", code], what="imports from a clean folder", timeout=120, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_prefect_yaml_carries_the_values_of_the_configs() -> None:
    """prefect.yaml cannot include a file, so the reference and example values are written there again."""
    project = yaml.safe_load((REPO / "prefect.yaml").read_text(encoding="utf-8"))
    llmjp = load_config(REPO / "configs" / "llmjp.yaml").model_dump(mode="json")
    example = load_config(REPO / "configs" / "example.yaml").model_dump(mode="json")
    fan_out_only = {"shards_per_flow_run", "fanout_deployment"}
    checked = 0
    for deployment in project["deployments"]:
        parameters = deployment.get("parameters") or {}
        if "config" not in parameters:
            continue
        config = config_from_dict(parameters["config"], source=deployment["name"]).model_dump(mode="json")
        expected = llmjp if deployment["name"] == "llmjp" else example
        assert deployment["name"] in ("llmjp", "example")
        differs = {key for key in expected["precompute"] if config["precompute"][key] != expected["precompute"][key]}
        assert differs <= fan_out_only, deployment["entrypoint"]
        config["precompute"] = {k: v for k, v in config["precompute"].items() if k not in fan_out_only}
        expected = expected | {"precompute": {k: v for k, v in expected["precompute"].items() if k not in fan_out_only}}
        assert config == expected, deployment["entrypoint"]
        checked += 1
    assert checked == 7


def test_kdflow_runs_from_a_folder_with_its_own_tasks_flows_and_schemas(
        make_config: Callable[..., Any], tiny_tokenizer_dir: Path, tmp_path: Path, prefect_api_url: str) -> None:
    """A user's Prefect project beside kdflow: the teacher worker and both torchrun ranks import kdflow's code."""
    project = tmp_path / "user-project"
    for name in ("tasks.py", "flows/__init__.py", "schemas/__init__.py"):
        (project / name).parent.mkdir(parents=True, exist_ok=True)
        (project / name).write_text(f"raise SystemExit('the user module {name} was imported by kdflow')\n")
    config = make_config(tokenizer=str(tiny_tokenizer_dir), **{
        "student__steps": 2, "student__save_every": 2, "student__distributed__nproc_per_node": 2,
        "student__distributed__rdzv_endpoint": f"127.0.0.1:{_free_port()}"})
    path = project / "config.yaml"
    path.write_text(dump_config(config), encoding="utf-8")
    env = {key: value for key, value in os.environ.items() if not key.startswith("PREFECT_")}
    # Against the session's Prefect server: what is tested is the user's folder, not another temporary server.
    env |= {"PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_API_URL": prefect_api_url}
    result = run([sys.executable, "-m", "kdflow", "run", str(path)], what="kdflow run from the user's project",
                 timeout=900, env=env, cwd=project)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "was imported by kdflow" not in result.stdout + result.stderr
    student = Path(config.run_root) / "students" / config.student.name
    assert (student / "final" / "config.json").is_file()
    output = result.stdout + result.stderr
    assert "teacher worker pid" in output  # the top-K pass ran in the worker process
    assert "rank 0 of 2" in output  # and the student in two torchrun ranks


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
