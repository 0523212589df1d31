"""Shared fixtures. Checkpoints come from the real producers (torch.save, safetensors,
huggingface_hub, transformers), made once per session."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed on the CPU (gloo), in tests and their torchrun children
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@dataclass
class Result:
    code: int
    out: str
    err: str


@pytest.fixture
def ckpt(capsys):
    """Run the CLI in-process (fast: torch is already imported) and return code, stdout, stderr."""
    from ckpt_cli.cli.app import main

    def run(*args: str | Path) -> Result:
        capsys.readouterr()
        try:
            main([str(a) for a in args])
            code = 0
        except SystemExit as exc:
            code = int(exc.code or 0)
        captured = capsys.readouterr()
        return Result(code, captured.out, captured.err)

    return run


def ckpt_quiet(*args: str | Path | int) -> None:
    """The CLI in-process, for session fixtures (no capsys there)."""
    from ckpt_cli.cli.app import main

    try:
        main([str(a) for a in args] + ["--quiet"])
    except SystemExit as exc:
        assert not exc.code, f"ckpt {' '.join(map(str, args))} exited {exc.code}"


def run_subprocess(*args: str | Path, env: dict[str, str] | None = None) -> Result:
    """The real entry point in a fresh process, as a user runs it."""
    proc = subprocess.run(
        [sys.executable, "-m", "ckpt_cli", *map(str, args)], capture_output=True, text=True, env={**os.environ, **(env or {})}
    )
    return Result(proc.returncode, proc.stdout, proc.stderr)


def mixed_state_dict() -> dict[str, torch.Tensor]:
    """Every dtype the formats share, plus 0-d, empty and odd-shaped tensors."""
    g = torch.Generator().manual_seed(0)
    return {
        "fp32": torch.randn(7, 5, generator=g),
        "bf16": torch.randn(3, 11, generator=g).to(torch.bfloat16),
        "fp16": torch.randn(13, generator=g).to(torch.float16),
        "fp64": torch.randn(2, 2, generator=g, dtype=torch.float64),
        "int64": torch.randint(-(2**40), 2**40, (4, 3), generator=g),
        "int32": torch.randint(-1000, 1000, (5,), generator=g, dtype=torch.int32),
        "int8": torch.randint(-128, 127, (6,), generator=g, dtype=torch.int8),
        "uint8": torch.randint(0, 255, (9,), generator=g, dtype=torch.uint8),
        "bool": torch.rand(3, 4, generator=g) > 0.5,
        "scalar": torch.tensor(3.25),
        "scalar_int": torch.tensor(7),
        "empty": torch.empty(0, 4),
        "empty_bf16": torch.empty(2, 0, dtype=torch.bfloat16),
        "layer.0.weight": torch.randn(4, 4, 2, generator=g),
    }


@pytest.fixture(scope="session")
def mixed_files(tmp_path_factory) -> dict[str, Path]:
    """The mixed state dict written by safetensors.save_file, torch.save and the hub's sharder."""
    from huggingface_hub import save_torch_state_dict
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("mixed")
    sd = mixed_state_dict()
    save_file(sd, root / "mixed.safetensors", metadata={"format": "pt"})
    torch.save(sd, root / "mixed.pt")
    (root / "hf").mkdir()
    save_torch_state_dict(sd, root / "hf", max_shard_size=200)
    return {"safetensors": root / "mixed.safetensors", "torch": root / "mixed.pt", "hf": root / "hf"}


def tiny_llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """A tiny Llama with tied embeddings, built from a config (no download), saved by transformers."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config())
    root = tmp_path_factory.mktemp("llama")
    model.save_pretrained(root / "single")  # one model.safetensors
    model.save_pretrained(root / "sharded", max_shard_size="20KB")
    return model, root


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """Same names, dtypes, shapes and bytes."""
    assert sorted(a) == sorted(b)
    for name in a:
        x, y = a[name], b[name]
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)), name


PRODUCERS = Path(__file__).parent / "producers"


def built_once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], None]) -> Path:
    """A folder made by build(folder) once per test run, for the producers' fixtures (a torchrun of them costs minutes).
    Under pytest-xdist every worker has a session of its own: the first to ask builds the folder in the run's shared
    temporary directory, holding a file lock; the others wait on the lock and reuse it, or fail with its error."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # pytest-N/, above this worker's popen-gwK/
    if os.environ.get("CKPT_TEST_BUILT"):
        # A developer's cache kept across runs (a folder of their choosing): the producers run once, not once per run.
        # Stale after a change to tests/producers/ or conftest's builds: delete the folder then. CI never sets it.
        base = Path(os.environ["CKPT_TEST_BUILT"])
        base.mkdir(parents=True, exist_ok=True)
    (base / "built").mkdir(exist_ok=True)
    root, done, failed = (base / "built" / f"{name}{suffix}" for suffix in ("", ".done", ".failed"))
    with FileLock(base / "built" / f"{name}.lock"):
        if failed.exists():
            raise AssertionError(f"building {name} failed in another worker:\n{failed.read_text()}")
        if not done.exists():
            shutil.rmtree(root, ignore_errors=True)
            root.mkdir()
            try:
                build(root)
            except Exception as exc:
                failed.write_text(str(exc))
                raise
            done.touch()
    return root


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_command(nproc: int) -> list[str]:
    """torchrun on this machine: nproc processes, a free rendezvous port."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port", str(free_port())]


def torchrun(nproc: int, script: str, *args: str | Path, timeout: int = 600, env: dict[str, str] | None = None) -> str:
    """Run a producer/consumer script under torchrun on the CPU (gloo); fail with its output."""
    label = f"torchrun {script} {' '.join(map(str, args))}"
    return _run_script([*torchrun_command(nproc), str(PRODUCERS / script), *map(str, args)], label, timeout, env)


def _run_script(cmd: list[str], label: str, timeout: int, env: dict[str, str] | None = None) -> str:
    """Run a test script with one thread per process and quiet warnings; fail with its output."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **(env or {})}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env)
    if proc.returncode != 0:
        raise AssertionError(f"{label} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc.stdout


@pytest.fixture(scope="session")
def fsdp2_saves(tmp_path_factory) -> dict[int, Path]:
    """Real FSDP2 + dcp.save checkpoints at world sizes 1-4 (one torchrun each); W=2 also saves a tiny Llama."""

    def build(root: Path) -> None:
        for world in (1, 2, 3, 4):
            torchrun(world, "fsdp2.py", "save", root / f"w{world}", *(["llama"] if world == 2 else []))

    root = built_once(tmp_path_factory, "fsdp2", build)
    return {world: root / f"w{world}" for world in (1, 2, 3, 4)}


@pytest.fixture(scope="session")
def orbax_saves(tmp_path_factory) -> Path:
    """Real Orbax saves of a JAX train state over 8 simulated CPU devices (tests/producers/orbax_train_state.py):
    ocdbt/7 (Orbax's defaults), zarr3/7 (OCDBT off), multi/7 (two JAX processes), and the arrays as .npy files."""
    pytest.importorskip("orbax.checkpoint")

    def build(root: Path) -> None:
        script = str(PRODUCERS / "orbax_train_state.py")
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
        subprocess.run([sys.executable, script, str(root)], check=True, capture_output=True, timeout=300, env=env)
        port, env["XLA_FLAGS"] = str(free_port()), "--xla_force_host_platform_device_count=4"
        procs = [
            subprocess.Popen(
                [sys.executable, script, str(root), "--process", str(i), "--processes", "2", "--port", port],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                env=env,
            )
            for i in range(2)
        ]
        errors = [p.communicate(timeout=300)[1] for p in procs]
        if any(p.returncode for p in procs):
            raise AssertionError(f"two-process Orbax save failed:\n{errors[0][-3000:].decode()}\n{errors[1][-3000:].decode()}")

    return built_once(tmp_path_factory, "orbax", build)


@pytest.fixture(scope="session")
def maxtext_saves(tmp_path_factory) -> Path:
    """A small Llama in MaxText's layout saved as MaxText saves its train state, scanned (float32) and not (bfloat16),
    with its config.json and its logits (tests/producers/maxtext_llama.py)."""
    pytest.importorskip("orbax.checkpoint")

    def build(root: Path) -> None:
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
        proc = subprocess.run(
            [sys.executable, str(PRODUCERS / "maxtext_llama.py"), str(root)], capture_output=True, text=True, timeout=300, env=env
        )
        if proc.returncode:
            raise AssertionError(f"the MaxText-layout save failed:\n{proc.stderr[-4000:]}")

    return built_once(tmp_path_factory, "maxtext", build)


DS_CONFIGS = ["stage1-fp32", "stage2-fp32", "stage3-fp32", "stage1-bf16", "stage2-bf16", "stage3-bf16", "stage1-bf16acc32", "stage2-fp32rr"]


@pytest.fixture(scope="session")
def ds_saves(tmp_path_factory) -> dict[int, Path]:
    """Real DeepSpeed ZeRO checkpoints: every config at world sizes 1, 2, 3 (one torchrun each); W=2 adds a tiny Llama."""

    def build(root: Path) -> None:
        for world in (1, 2, 3):
            torchrun(world, "deepspeed_train.py", "save", root / f"w{world}", *DS_CONFIGS, *(["llama"] if world == 2 else []))

    root = built_once(tmp_path_factory, "deepspeed", build)
    return {world: root / f"w{world}" for world in (1, 2, 3)}


def ds_to_universal(tag_folder: Path, out: Path) -> dict[str, dict[str, torch.Tensor]]:
    """DeepSpeed's own per-parameter extraction of a ZeRO checkpoint (its universal-checkpoint tool):
    parameter name -> {fp32, exp_avg, exp_avg_sq, step} (frozen params and tied aliases: fp32 only)."""
    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(tag_folder)]
    cmd += ["--output_folder", str(out), "--inject_missing_state", "--num_extract_workers", "1", "--num_merge_workers", "1"]
    subprocess.run(cmd, check=True, capture_output=True)
    params = {}
    for param in (p for p in (out / "zero").iterdir() if p.is_dir()):
        loaded = {f.stem: torch.load(f, weights_only=False) for f in param.iterdir()}
        params[param.name] = {k: v["param"] if isinstance(v, dict) else v for k, v in loaded.items()}
    return params


def assert_fails(res: Result, *needles: str) -> None:
    """Exit code 1, no traceback, and every needle named in the output."""
    text = res.out + res.err
    assert res.code == 1 and "Traceback" not in text, text
    for needle in needles:
        assert needle in text, (needle, text)


class Evil:
    """A pickle payload that would create `marker` if anything ever ran it."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


# ---- run folders as the frameworks write them (tests/producers/run_folders.py) ---------------------------

RUN_FOLDERS_TWO_PROCESS = [
    "trainer-ds2",
    "trainer-ds3",
    "trainer-fsdp2",
    "accelerate-fsdp2",
    "accelerate-ds",
    "lightning-ds2",
    "lightning-ds3",
    "lightning-fsdp",
]
RUN_FOLDERS_ONE_PROCESS = ["trainer-plain", "lightning-plain"]
RUN_FOLDERS = RUN_FOLDERS_TWO_PROCESS + RUN_FOLDERS_ONE_PROCESS
# Saved by the frameworks, refused by ckpt by name (accelerate FSDP1 per-rank files: docs/formats.md §7.3)
RUN_FOLDERS_REFUSED = ["accelerate-fsdp1-local", "accelerate-fsdp1-nodcp"]


def producer(script: str, *args: str | Path, timeout: int = 600) -> str:
    """Run a producer script in one plain process (no torchrun); fail with its output."""
    return _run_script([sys.executable, str(PRODUCERS / script), *map(str, args)], f"{script} {' '.join(map(str, args))}", timeout)


@pytest.fixture(scope="session")
def run_folders(tmp_path_factory) -> dict[str, Path]:
    """Run roots as transformers Trainer, accelerate and Lightning save them through their own save paths, on the
    CPU: name -> the run root (BASE/runs/NAME). A tiny Llama, 4 steps, a checkpoint every 2 steps. The runs in
    RUN_FOLDERS_TWO_PROCESS come from one torchrun of 2 processes, the two plain ones from one plain process.
    What each run held at each save: run_folder_saved(root, step)."""

    def build(base: Path) -> None:
        torchrun(2, "run_folders.py", "save", base, *RUN_FOLDERS_TWO_PROCESS, *RUN_FOLDERS_REFUSED)
        producer("run_folders.py", "save", base, *RUN_FOLDERS_ONE_PROCESS)

    base = built_once(tmp_path_factory, "run_folders", build)
    return {name: base / "runs" / name for name in RUN_FOLDERS + RUN_FOLDERS_REFUSED}


def run_folder_checkpoint(root: Path, step: int = 4) -> Path:
    """The checkpoint folder (or Lightning .ckpt file) a run root holds for a step (2 or 4)."""
    framework = root.name.split("-")[0]
    if framework == "trainer":
        return root / f"checkpoint-{step}"
    if framework == "accelerate":  # automatic_checkpoint_naming counts saves, not steps
        return root / "checkpoints" / f"checkpoint_{step // 2 - 1}"
    return root / "lightning_logs" / "version_0" / "checkpoints" / f"epoch=0-step={step}.ckpt"


def run_folder_saved(root: Path, step: int = 4) -> dict:
    """What the run held when it saved at `step`, full tensors by parameter name: {weights, optimizer: {name:
    {exp_avg, exp_avg_sq[, step]}}, lr: [per param group], step, scheduler: its state_dict()}."""
    return torch.load(root.parent.parent / "saved" / root.name / f"step-{step}.pt", weights_only=False)


def resume_run_folders(world: int, checkpoints: dict[str, Path], out: Path) -> dict[str, dict]:
    """Resume each run (name -> checkpoint folder) with its framework's own resume path at `world` processes, all
    in one launch (Trainer resume_from_checkpoint, accelerate load_state, Lightning fit(ckpt_path=...)); return
    what each loaded, in run_folder_saved's layout. Plain runs resume in one plain process (world must be 1)."""
    tasks = [f"{name}:{checkpoint}:{out / name}" for name, checkpoint in checkpoints.items()]
    plain = [name for name in checkpoints if name in RUN_FOLDERS_ONE_PROCESS]
    if plain:
        assert world == 1 and len(plain) == len(tasks), "plain runs resume alone, in one process"
        producer("run_folders.py", "resume", *tasks)
    else:
        torchrun(world, "run_folders.py", "resume", *tasks)
    return {name: torch.load(out / name / "loaded.pt", weights_only=False) for name in checkpoints}


def consolidate_run_folders(checkpoints: dict[str, Path], out: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Each framework's own consolidation of a checkpoint folder (name -> folder): zero_to_fp32.py shipped in it
    (Trainer, accelerate DeepSpeed), `accelerate merge-weights` (FSDP2), Lightning's
    convert_zero_checkpoint_to_fp32_state_dict and consolidate_checkpoint; the plain runs' own weights. Returns the
    weights by the names the tool wrote (Lightning: the LightningModule's, 'model.' + the Llama's)."""
    from safetensors.torch import load_file

    producer("run_folders.py", "consolidate", *(f"{name}:{checkpoint}:{out / name}" for name, checkpoint in checkpoints.items()))
    return {name: load_file(out / name / "reference.safetensors") for name in checkpoints}


@pytest.fixture(scope="session")
def run_folders_consolidated(run_folders, tmp_path_factory) -> dict[str, dict[str, torch.Tensor]]:
    """Each run's step-4 checkpoint consolidated by its framework's own tool (consolidate_run_folders)."""
    from safetensors.torch import load_file

    checkpoints = {name: run_folder_checkpoint(run_folders[name]) for name in RUN_FOLDERS}
    out = built_once(tmp_path_factory, "consolidated", lambda root: consolidate_run_folders(checkpoints, root))
    return {name: load_file(out / name / "reference.safetensors") for name in checkpoints}


# ---- DeepSpeed MoE (expert parallel), tests/producers/deepspeed_moe.py -------------------------------------

DS_MOE_W2 = ["stage1-fp32-ep2", "stage2-bf16-ep2", "stage1-bf16acc32-ep2", "stage2-fp32-ep2-mixed", "stage0-fp32-ep2"]
DS_MOE_W4 = ["stage2-fp32-ep2", "stage1-bf16-ep2-dbe", "stage2-fp32-ep2-mixed", "stage1-fp32-ep4"]
# Reshards that keep the expert-parallel size: (config, saved at, to world size)
DS_MOE_RESHARDS = [(c, 2, 4) for c in DS_MOE_W2] + [(c, 4, 2) for c in DS_MOE_W4 if not c.endswith("-ep4")]
# Reshards that change the expert-parallel size: (saved at, config, to world size, the config DeepSpeed loads it with, options)
DS_MOE_EP_CHANGES = [
    (2, "stage1-fp32-ep2", 1, "stage1-fp32-ep1", ()),
    (2, "stage2-bf16-ep2", 1, "stage2-bf16-ep1", ()),
    (2, "stage1-bf16acc32-ep2", 1, "stage1-bf16acc32-ep1", ()),
    (2, "stage2-fp32-ep2-mixed", 1, "stage2-fp32-ep1", ()),
    (2, "stage1-fp32-ep2", 2, "stage1-fp32-ep1", ("--ep-size", "1")),
    (2, "stage0-fp32-ep2", 1, "stage0-fp32-ep1", ()),
    (2, "stage2-bf16-ep2", 4, "stage2-bf16-ep4", ("--ep-size", "moe=4")),
    (4, "stage1-fp32-ep4", 2, "stage1-fp32-ep2", ()),
]


def ds_moe_ep_change_name(src: int, config: str, dst: int, load: str) -> str:
    return f"{config}-{src}to{dst}-as-{load}"


@pytest.fixture(scope="session")
def ds_moe(tmp_path_factory) -> Path:
    """Real DeepSpeed MoE runs (deepspeed.moe.layer.MoE, ZeRO-0/1/2) saved at world sizes 2 and 4, each resharded by ckpt to
    the other size (and, for DS_MOE_EP_CHANGES, to a new expert-parallel size) and loaded there by DeepSpeed with a plain
    load_checkpoint. Four torchrun launches: save at 2; save at 4 and load the reshards to 4; load
    the reshards to 2; load the reshards to 1.
    ROOT/w{2,4}/CONFIG: the saves, each with reference.pt (what the run held); ROOT/reshard/NAME: ckpt's reshards
    (CONFIG-{2to4,4to2} or ds_moe_ep_change_name); ROOT/loaded/NAME/loaded.pt: what DeepSpeed loaded from them, in
    reference.pt's layout."""

    def build(root: Path) -> None:
        torchrun(2, "deepspeed_moe.py", "save", root / "w2", *DS_MOE_W2)
        tasks: dict[int, list[str]] = {1: [], 2: [], 4: []}
        reshards: dict[int, list[tuple[Path, Path, tuple[str, ...]]]] = {2: [], 4: []}
        for config, src, dst in DS_MOE_RESHARDS:
            name = f"{config}-{src}to{dst}"
            tasks[dst].append(f"{root / 'reshard' / name}:{config}:{root / 'loaded' / name}")
            reshards[src].append((root / f"w{src}" / config, root / "reshard" / name, ("--world-size", str(dst))))
        for src, config, dst, load, options in DS_MOE_EP_CHANGES:
            name = ds_moe_ep_change_name(src, config, dst, load)
            tasks[dst].append(f"{root / 'reshard' / name}:{load}:{root / 'loaded' / name}")
            reshards[src].append((root / f"w{src}" / config, root / "reshard" / name, ("--world-size", str(dst), *options)))
        for source, dest, options in reshards[2]:
            ckpt_quiet("reshard", source, dest, *options)
        torchrun(4, "deepspeed_moe.py", "save", root / "w4", *DS_MOE_W4, "+", "load", *tasks[4])
        for source, dest, options in reshards[4]:
            ckpt_quiet("reshard", source, dest, *options)
        torchrun(2, "deepspeed_moe.py", "load", *tasks[2])
        torchrun(1, "deepspeed_moe.py", "load", *tasks[1])

    return built_once(tmp_path_factory, "ds_moe", build)


DS_PIPE = ["stage1-fp32", "stage1-bf16"]


@pytest.fixture(scope="session")
def ds_pipe(tmp_path_factory) -> Path:
    """Real DeepSpeed pipeline-parallel runs (PipelineModule, 2 stages, ZeRO-1) saved at world sizes 2 (1 data-parallel rank
    per stage) and 4 (2), each resharded by ckpt to the other size and loaded there by DeepSpeed with a plain
    load_checkpoint. Three torchrun launches. ROOT/w{2,4}/CONFIG (with reference.pt), ROOT/reshard/CONFIG-{2to4,4to2},
    ROOT/loaded/CONFIG-{2to4,4to2}/loaded.pt (tests/producers/deepspeed_pipe.py)."""

    def build(root: Path) -> None:
        torchrun(2, "deepspeed_pipe.py", "save", root / "w2", *DS_PIPE)
        tasks: dict[int, list[str]] = {2: [], 4: []}
        for src, dst in ((2, 4), (4, 2)):
            tasks[dst] = [f"{root / 'reshard' / f'{c}-{src}to{dst}'}:{c}:{root / 'loaded' / f'{c}-{src}to{dst}'}" for c in DS_PIPE]
        for config in DS_PIPE:
            ckpt_quiet("reshard", root / "w2" / config, root / "reshard" / f"{config}-2to4", "--world-size", 4)
        torchrun(4, "deepspeed_pipe.py", "save", root / "w4", *DS_PIPE, "+", "load", *tasks[4])
        for config in DS_PIPE:
            ckpt_quiet("reshard", root / "w4" / config, root / "reshard" / f"{config}-4to2", "--world-size", 2)
        torchrun(2, "deepspeed_pipe.py", "load", *tasks[2])

    return built_once(tmp_path_factory, "ds_pipe", build)


# ---- per-rank DTensor torch.save files and DCP with safetensors serialization (tests/producers/dtensor_saves.py) ----

DTENSOR_W2 = ["fsdp2", "skyrl", "fsdp1", "dcp-st", "dcp-hf", "dcp-hfc"]
DTENSOR_W4 = ["fsdp2", "hsdp", "tp"]


@pytest.fixture(scope="session")
def dtensor_saves_2(tmp_path_factory) -> Path:
    """One torchrun of 2 processes: ROOT/CONFIG for each of DTENSOR_W2 (verl-style rank files from FSDP2 and FSDP1; DCP
    with safetensors serialization from FileSystemWriter and HuggingFaceStorageWriter) and ROOT/references/CONFIG.pt."""

    def build(root: Path) -> None:
        torchrun(2, "dtensor_saves.py", "save", root, *DTENSOR_W2)

    return built_once(tmp_path_factory, "dtensor_w2", build)


@pytest.fixture(scope="session")
def dtensor_saves_4(tmp_path_factory) -> Path:
    """One torchrun of 4 processes: verl-style rank files from FSDP2 (1-D), HSDP (2x2) and FSDP2 + tensor parallel (2x2)."""

    def build(root: Path) -> None:
        torchrun(4, "dtensor_saves.py", "save", root, *DTENSOR_W4)

    return built_once(tmp_path_factory, "dtensor_w4", build)


# ---- FSDP2 + tensor parallel on a 2-D mesh, saved with DCP (tests/producers/dcp_tp.py) ----------------------------

DCP_TP_MESHES = ["4x1", "1x4", "2x2"]  # dp x tp meshes of 4 ranks the 2x2 save is resharded to and loaded on


@pytest.fixture(scope="session")
def dcp_tp(tmp_path_factory) -> Path:
    """FSDP2 + tensor parallel on a 2x2 (dp, tp) mesh and FSDP2 alone on 4 ranks, saved with dcp.save; the first resharded by
    ckpt to each of DCP_TP_MESHES and loaded there by dcp.load + set_state_dict. Two torchrun launches of 4 processes.
    ROOT/{tp,fsdp}: the saves; ROOT/references/{tp,fsdp}.pt: what the runs held (full tensors); ROOT/reshard/MESH: ckpt reshard
    --world-size 4 --tp T; ROOT/loaded/MESH/loaded.pt: what the model on MESH loaded from it; ROOT/loaded/MESH/resaved: its dcp.save."""

    def build(root: Path) -> None:
        torchrun(4, "dcp_tp.py", "save", root, "tp", "fsdp")
        tasks = []
        for mesh in DCP_TP_MESHES:
            ckpt_quiet("reshard", root / "tp", root / "reshard" / mesh, "--world-size", 4, "--tp", mesh.split("x")[1])
            tasks.append(f"{root / 'reshard' / mesh}:{mesh}:{root / 'loaded' / mesh}")
        torchrun(4, "dcp_tp.py", "load", *tasks)

    return built_once(tmp_path_factory, "dcp_tp", build)


# ---- Megatron-Core torch_dist (tests/producers/megatron_save.py) --------------------------------------------------


@pytest.fixture(scope="session")
def mcore(tmp_path_factory) -> Path:
    """Megatron's GPTModel at TP=2 saved by dist_checkpointing.save, one torchrun of 2 processes: ROOT/{stacked,per_layer}
    and ROOT/reference.pt (what the model held)."""

    def build(root: Path) -> None:
        torchrun(2, "megatron_save.py", root)

    return built_once(tmp_path_factory, "megatron", build)


# ---- object storage: a moto server in server mode (tests/s3_store.py) ---------------------------------------------


def v4_logits(release: Path, ids: list[int]) -> dict:
    """The release's logits for `ids` as transformers v4 computes them, in the venv $CKPT_TRANSFORMERS_V4 names (.ci/run
    makes it); skipped without one. {"logits", "version", "missing", "unexpected"} (tests/producers/transformers_v4_logits.py)."""
    python = os.environ.get("CKPT_TRANSFORMERS_V4")
    if not python or not Path(python).exists():
        pytest.skip("no transformers v4 venv ($CKPT_TRANSFORMERS_V4; .ci/run makes one)")
    out = release.parent / f"{release.name}.v4_logits.pt"
    script = Path(__file__).parent / "producers" / "transformers_v4_logits.py"
    subprocess.run([python, str(script), str(release), str(out), *map(str, ids)], check=True, capture_output=True, timeout=600)
    return torch.load(out, weights_only=False)


AZURITE = "azurite@3.35.0"
NO_AZURITE = "Azurite (the Azure Storage emulator) needs Node.js and npm, which this machine lacks: apt-get install nodejs npm"


def azurite_command() -> str | None:
    """Azurite's blob server: $CKPT_AZURITE, azurite-blob on PATH, or else installed from npm once into the user's cache
    (~/.cache/ckpt-tests), so that the README's test command runs the az:// tests wherever npm is; None without npm."""
    import shutil

    from filelock import FileLock

    found = os.environ.get("CKPT_AZURITE") or shutil.which("azurite-blob")
    if found and Path(found).exists():
        return found
    npm = shutil.which("npm")
    if npm is None:
        return None
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ckpt-tests" / AZURITE.replace("@", "-")
    binary = cache / "node_modules" / ".bin" / "azurite-blob"
    cache.mkdir(parents=True, exist_ok=True)
    with FileLock(cache.parent / f"{cache.name}.lock"):
        if not binary.exists():
            cmd = [npm, "install", "--prefix", str(cache), "--no-audit", "--no-fund", "--silent", AZURITE]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            assert proc.returncode == 0 and binary.exists(), f"npm install {AZURITE} failed: {proc.stderr[-2000:]}"
    return str(binary)


@pytest.fixture(scope="session")
def az(tmp_path_factory):
    """A container on Azurite, the Azure Storage emulator, started here on a free port, with
    AZURE_STORAGE_CONNECTION_STRING pointing ckpt at it for the session; skipped without adlfs or Azurite."""
    pytest.importorskip("adlfs")
    command = azurite_command()
    if command is None:
        pytest.skip(NO_AZURITE)
    import socket
    import time

    from az_store import CONTAINER, Azure, connection_string

    port = free_port()
    where = tmp_path_factory.mktemp("azurite")
    args = [command, "--blobHost", "127.0.0.1", "--blobPort", str(port), "--location", str(where), "--silent", "--skipApiVersionCheck"]
    server = subprocess.Popen([*args, "--loose"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert server.poll() is None, f"Azurite did not start: {server.stderr.read().decode()[-2000:]}"
            assert time.monotonic() < deadline, "Azurite did not start within 60 s"
            time.sleep(0.2)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("AZURE_STORAGE_CONNECTION_STRING", connection_string(port))
            store = Azure(connection_string(port))
            store.service.create_container(CONTAINER)
            yield store
    finally:
        server.terminate()
        server.wait(timeout=30)


@pytest.fixture(scope="session")
def s3():
    """An S3 bucket on a moto server started here (a real HTTP endpoint on a free port), with the AWS variables that
    point ckpt at it set for the session; skipped without the s3 test dependencies."""
    pytest.importorskip("s3fs")
    pytest.importorskip("boto3")
    server_module = pytest.importorskip("moto.server")
    import logging

    from s3_store import BUCKET, ISOLATED, S3

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = server_module.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {
        "AWS_ENDPOINT_URL": f"http://{host}:{port}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        **ISOLATED,
    }
    with pytest.MonkeyPatch.context() as mp:
        for name, value in env.items():
            mp.setenv(name, value)
        mp.delenv("AWS_PROFILE", raising=False)
        store = S3(env["AWS_ENDPOINT_URL"], env)
        store.client.create_bucket(Bucket=BUCKET)
        yield store
    server.stop()
