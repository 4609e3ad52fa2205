"""The CUDA backend's Triton source (engine/backends/triton_cuda.py is the backend): guide_kernels.py (the
guide's scores, weighted values and the gather from the pinned store), decode_kernels.py (the fused guided
decode's attention and the new K/V's write), select_kernels.py (its selection of the next fetched set), build.py (the kernels compiled for a GPU target without one, for tests/test_triton_compile.py).
Each imports Triton and is imported only where its kernels run or compile (CUDA, or Triton's interpreter in
the tests): importing Triton costs ~0.25 s, and this package's own import imports none of them."""
