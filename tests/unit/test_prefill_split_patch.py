"""serving/prefill_split_patch.py: vLLM's per-request split of P's cached tokens copied into the
answer's ``kv_transfer_params``, on vLLM's own output structs (the real scheduler through real
workers: tests/integration/test_pulled_tokens_vllm.py)."""

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
from vllm.v1.metrics.stats import PrefillStats

from serving import prefill_split_patch as patch


def _stats(prompt: int, local: int, external: int) -> PrefillStats:
    stats = PrefillStats()
    stats.set(num_prompt_tokens=prompt, num_local_cached_tokens=local, num_external_cached_tokens=external)
    return stats


def _outputs() -> dict[int, EngineCoreOutputs]:
    pulled = EngineCoreOutput("pulled", [7], kv_transfer_params={"remote_prefill_cached_tokens": 3968},
                              prefill_stats=_stats(4100, 256, 3712))
    no_remote = EngineCoreOutput("local", [7], kv_transfer_params={"do_remote_decode": True},
                                 prefill_stats=_stats(900, 768, 0))
    no_stats = EngineCoreOutput("later", [8], kv_transfer_params={"remote_prefill_cached_tokens": 5})
    return {0: EngineCoreOutputs(outputs=[pulled, no_remote]), 1: EngineCoreOutputs(outputs=[no_stats])}


def test_annotate_copies_vllms_own_figures_only_where_p_reports_its_cached_sum():
    outs = _outputs()
    assert patch.annotate(outs) == 1
    pulled, no_remote = outs[0].outputs
    assert pulled.kv_transfer_params == {"remote_prefill_cached_tokens": 3968, patch.EXTERNAL_KEY: 3712,
                                         patch.LOCAL_KEY: 256}
    assert pulled.kv_transfer_params[patch.EXTERNAL_KEY] + pulled.kv_transfer_params[patch.LOCAL_KEY] == 3968
    assert no_remote.kv_transfer_params == {"do_remote_decode": True}
    assert outs[1].outputs[0].kv_transfer_params == {"remote_prefill_cached_tokens": 5}


def test_patched_scheduler_annotates_its_result_once(monkeypatch):
    class _Scheduler:
        def update_from_output(self, scheduler_output, model_runner_output):
            return _outputs()

    assert patch.patch_scheduler_class(_Scheduler)
    assert not patch.patch_scheduler_class(_Scheduler)  # idempotent
    out = _Scheduler().update_from_output(None, None)
    assert out[0].outputs[0].kv_transfer_params[patch.EXTERNAL_KEY] == 3712
    monkeypatch.setattr(Scheduler, "update_from_output", Scheduler.update_from_output)
    assert patch.apply()
    assert not patch.apply()
    assert getattr(Scheduler.update_from_output, "__wrapped__", None) is not None


def test_a_process_vllm_spawns_from_the_worker_entry_is_patched_too():
    """vLLM spawns its engine core on CPU; Python's spawn runs the parent's main module by name as
    ``__mp_main__`` in the child, which is where the scheduler must be patched."""
    import subprocess
    import sys

    code = ("import runpy; runpy.run_module('serving.vllm_worker', run_name='__mp_main__', alter_sys=True); "
            "from vllm.v1.core.sched.scheduler import Scheduler; "
            f"print(getattr(Scheduler.update_from_output, {patch._PATCHED_ATTR!r}, False))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip().splitlines()[-1] == "True"
