"""`gpt-jax serve --tensor-parallel 2`: the server on 2 host CPU devices answers as one
device and reports its mesh. Apart from test_tensor_parallel.py, whose one subprocess
takes minutes: under `make test` (--dist loadfile) this module runs on another worker."""

from test_hf_dirs import hf_dir  # noqa: F401 (a fixture)


def test_serve_tensor_parallel_answers_as_one_device_and_reports_its_mesh(hf_dir):
    """`gpt-jax serve --tensor-parallel 2` (a subprocess; the CPU host split into 2 devices):
    a greedy completion is the one-device `LLM.from_pretrained` text, and /metrics reports
    the mesh and half the KV pool bytes per device (2 kv heads, one per device)."""
    import httpx2 as httpx
    from prometheus_client.utils import floatToGoString

    from conftest import free_port, start_serve
    from test_hf_dirs import TEXTS, assert_greedy_served

    path, _ = hf_dir
    port = free_port()
    proc = start_serve(["--hf-checkpoint", str(path), "--max-slots", "2", "--no-warmup",
                        "--tensor-parallel", "2"], port)
    try:
        llm = assert_greedy_served(port, path, TEXTS[0])
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
        one = llm.engine(2).stats()["mesh"]["kv_cache_bytes_per_device"]
        for line in ('gpt_jax:mesh_axis_size{axis="model"} 2.0', "gpt_jax:mesh_devices 2.0",
                     f"gpt_jax:kv_cache_bytes_per_device {floatToGoString(one // 2)}"):
            assert line in metrics, metrics
    finally:
        proc.kill()
        proc.wait(timeout=30)
