"""The Triton kernels compiled for a GPU target on a machine without one: Triton's own compiler (its MLIR
passes, then the ptxas its wheel ships) builds the PTX and the cubin for a compute capability named here
(sm_80, sm_90), specialized exactly as a launch would be (the runtime's binder reads the launch's own
arguments: their types, 16-byte alignment and divisibility, the constexprs), and the result is read back:
registers, spilled bytes and stack frame (ptxas -v), shared memory per block against the target's limit,
and whether the PTX uses the tensor cores (``mma`` / ``wgmma``). tests/test_triton_compile.py compiles every
kernel at the engine's launch configurations with it; a planner could read a kernel's registers and shared
memory for its occupancy.

The launches come from the engine's launch code itself (``recording``: the kernels swapped for recorders
while a wrapper of engine/backends/triton_guide.py or triton_decode.py runs on CPU tensors), so the
signatures cannot drift from what the engine passes. Triton's interpreter (TRITON_INTERPRET=1) replaces
parts of triton.language in the process that runs it, so compiling happens in a process of its own
(tests/triton_compile_run.py)."""
from __future__ import annotations

import contextlib
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability
from triton.compiler import ASTSource, compile as triton_compile, make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

# Shared memory one block may use (the opt-in maximum), per compute capability
SHARED_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}


@dataclass(frozen=True)
class Launch:
    """One launch as the engine makes it: a label, the kernel, its positional arguments and its keyword ones
    (constexprs and launch options such as num_warps)."""

    label: str
    kernel: object
    args: tuple
    meta: dict


@dataclass(frozen=True)
class Built:
    """What one compile gave: the target's capability, registers per thread, spilled bytes (stores + loads),
    stack frame bytes, shared memory per block and its limit, warps, and the tensor-core instructions seen."""

    label: str
    arch: int
    registers: int
    spill_bytes: int
    stack_bytes: int
    shared: int
    shared_limit: int
    num_warps: int
    mma: bool
    wgmma: bool
    ptx_local: bool

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class Recorder:
    """Stands in for a jitted kernel: ``rec[grid](*args, **meta)`` records the launch instead of running it."""

    def __init__(self, kernel, label: str, into: list[Launch]):
        self.kernel, self.label, self.into = kernel, label, into

    def __getitem__(self, grid):
        def record(*args, **meta):
            self.into.append(Launch(self.label, self.kernel, args, meta))
        return record


def jit_function(kernel) -> JITFunction:
    """The compiler's view of a kernel: the JITFunction itself, or one made from an interpreted kernel's
    Python function."""
    return kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn)


def specialization(fn: JITFunction, launch: Launch, target: GPUTarget):
    """(signature, constexprs, attrs, options) of a launch, by the runtime's own binder for that target."""
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, spec, options = binder(*launch.args, **launch.meta)
    return fn._pack_args(backend, launch.meta, bound, spec, options)


def compile_launch(launch: Launch, arch: int) -> Built:
    """Compile a launch for compute capability `arch` (80: sm_80, 90: sm_90a) and read back its resources.
    A kernel that cannot compile raises (Triton's CompilationError, or ptxas's failure)."""
    fn = jit_function(launch.kernel)
    target = GPUTarget("cuda", arch, 32)
    options, signature, constexprs, attrs = specialization(fn, launch, target)
    with knobs.runtime.scope():
        knobs.runtime.interpret = False
        compiled = triton_compile(ASTSource(fn, signature, constexprs, attrs), target=target,
                                  options=options.__dict__)
    ptx = compiled.asm["ptx"]
    usage = ptxas_usage(ptx, arch)
    return Built(launch.label, arch, usage["registers"], usage["spill_bytes"], usage["stack_bytes"],
                 compiled.metadata.shared, SHARED_LIMIT[arch], compiled.metadata.num_warps,
                 bool(re.search(r"^\s*mma\.sync", ptx, re.M)), bool(re.search(r"^\s*wgmma\.", ptx, re.M)),
                 bool(re.search(r"^\s*\.local\b", ptx, re.M)))


def ptxas_usage(ptx: str, arch: int) -> dict:
    """ptxas -v of the PTX for its target (the same ptxas Triton assembles with): registers per thread, spill
    stores + loads in bytes, stack frame bytes."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        log = subprocess.run([get_ptxas(arch).path, "-v", "-lineinfo", "--regAllocOptLevel=2",
                              f"--gpu-name={sm_arch_from_capability(arch)}", str(src), "-o", str(src) + ".o"],
                             check=True, capture_output=True, text=True).stderr
    number = lambda pattern: sum(int(x) for x in re.findall(pattern, log))  # noqa: E731
    return {"registers": number(r"Used (\d+) registers"),
            "spill_bytes": number(r"(\d+) bytes spill stores") + number(r"(\d+) bytes spill loads"),
            "stack_bytes": number(r"(\d+) bytes stack frame")}


@contextlib.contextmanager
def recording(module, labels: tuple[str, ...], into: list[Launch]):
    """While inside: module's ``kernels()`` (the loader of its kernel tuple) gives recorders of those kernels,
    labelled in order by `labels`, appending to `into`; the loader restored after. A recorder launches nothing,
    so the module's wrappers may take CPU tensors meanwhile (its ``interpreted()``, where it has one, says so)."""
    real, interpreted = module.kernels, getattr(module, "interpreted", None)
    recorders = tuple(Recorder(k, label, into) for k, label in zip(real(), labels))
    module.kernels = lambda: recorders
    if interpreted is not None:
        module.interpreted = lambda: True
    try:
        yield into
    finally:
        module.kernels = real
        if interpreted is not None:
            module.interpreted = interpreted
