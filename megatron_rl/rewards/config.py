"""Reward configuration: which verifier scores which data, its timeouts, the sandbox and the judge."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_rl.config.base import ConfigBase, ConfigError, ranged


@dataclass(kw_only=True)
class MathConfig(ConfigBase):
    # Hard wall-clock limit per response (seconds): past it the worker is killed, respawned, and the
    # response scores a counted zero (reward/timeouts).
    timeout_s: float = ranged(10.0, gt=0.0)
    # math-verify's own SIGALRM timeouts (whole seconds) for parsing and for comparing; they catch
    # slow sympy code, the hard timeout above catches what SIGALRM cannot (a big-int power in C).
    parse_timeout_s: int = ranged(3, ge=1)
    verify_timeout_s: int = ranged(5, ge=1)
    # Accept "96%" for a ground truth "96" (and the reverse) when the numbers are equal.
    percent_equivalence: bool = True
    # Accept pi (or a Chinese "圆周率") for a decimal ground truth that rounds pi at its own
    # precision (3.14, 3.1416), and a decimal prediction that rounds pi when the ground truth is pi or
    # such a decimal. Never a general "close enough" rule: 0.54 is not accepted for 0.5.
    pi_tolerance: bool = True
    # Fall back to the last number in the response when it has no \boxed{} answer.
    fallback_last_number: bool = False


@dataclass(kw_only=True)
class SandboxConfig(ConfigBase):
    # Wall-clock limit of one program run (seconds); the whole process tree is killed past it.
    timeout_s: float = ranged(5.0, gt=0.0)
    # CPU seconds per process (RLIMIT_CPU).
    cpu_s: int = ranged(5, ge=1)
    # Address space per process in MiB (RLIMIT_AS).
    memory_mb: int = ranged(512, ge=1)
    # Processes the program may have at once (RLIMIT_NPROC, enforced under a private uid).
    max_procs: int = ranged(8, ge=1)
    # Largest file the program may write, in MiB (RLIMIT_FSIZE; also bounds its captured output).
    file_size_mb: int = ranged(16, ge=1)
    # MiB the program may store in its private /tmp (which holds its working directory) and in its
    # private /dev/shm (tmpfs, so RAM; with bubblewrap only: without it only file_size_mb applies).
    disk_mb: int = ranged(64, ge=1)
    # Bytes of stdout/stderr kept for scoring.
    max_output_bytes: int = ranged(1 << 20, ge=1)
    # Interpreter that runs the programs; "" finds python3 on /usr/local/bin:/usr/bin:/bin. The program
    # sees it (its prefixes and sys.path, read-only) and nothing else of the host; it must be readable
    # by other users (a venv under /root is not).
    python: str = ""
    # Refuse to run code rewards when the bubblewrap sandbox is unavailable (bwrap missing, or no user
    # namespaces): the error names the fix (apt-get install bubblewrap). False is the explicit opt-in
    # to run programs with rlimits only, without file-system or network isolation (warned once).
    require_isolation: bool = True
    # When running as root, programs run under a private uid drawn from
    # [uid_base, uid_base + uid_span), so RLIMIT_NPROC counts only that run's processes.
    uid_base: int = ranged(200_000, ge=1000)
    uid_span: int = ranged(100_000, ge=1)
    # Parent directory of the per-run working directories ("" = the system temp dir).
    work_root: str = ""


@dataclass(kw_only=True)
class CodeConfig(ConfigBase):
    # "pass_rate": fraction of test cases passed; "all_pass": 1 only when every case passes.
    mode: str = "pass_rate"
    # Hard wall-clock limit for all test cases of one response; past it the pool worker is killed.
    timeout_s: float = ranged(60.0, gt=0.0)
    # Stop at the first failing case (only meaningful with mode "all_pass").
    stop_on_first_failure: bool = True
    # At most this many test cases run per response (the rest are skipped and count as failed).
    max_cases: int = ranged(64, ge=1)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)

    def validate(self) -> None:
        super().validate()
        if self.mode not in ("pass_rate", "all_pass"):
            self.fail("mode", f"must be 'pass_rate' or 'all_pass', got {self.mode!r}")
        if self.timeout_s <= self.sandbox.timeout_s:
            self.fail("timeout_s", f"must exceed sandbox.timeout_s ({self.sandbox.timeout_s}): it "
                                   "bounds all test cases of one response")


@dataclass(kw_only=True)
class JudgeConfig(ConfigBase):
    # "off"; "fallback": ask the judge only when the rule verifier says wrong/unparsable;
    # "main": the judge decides for every response of the judged styles.
    mode: str = "off"
    # OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1 (a vLLM server).
    base_url: str = ""
    model: str = ""
    # Name of an environment variable holding the API key ("" = no Authorization header).
    api_key_env: str = ""
    # Seconds per HTTP request; a timed-out request is a counted zero (no flip in fallback mode).
    timeout_s: float = ranged(30.0, gt=0.0)
    # Concurrent requests.
    max_concurrency: int = ranged(8, ge=1)
    # Tokens the judge may write.
    max_tokens: int = ranged(256, ge=1)
    # Styles the judge applies to (by resolved style name).
    styles: list[str] = field(default_factory=lambda: ["math"])

    def validate(self) -> None:
        super().validate()
        if self.mode not in ("off", "fallback", "main"):
            self.fail("mode", f"must be 'off', 'fallback' or 'main', got {self.mode!r}")
        if self.mode != "off" and not self.base_url:
            self.fail("base_url", "is required when judge.mode is not 'off'")


@dataclass(kw_only=True)
class UserFunctionsConfig(ConfigBase):
    # Hard wall-clock limit per response of a user reward function (reward.functions) run in the
    # process pool: past it the worker is killed and replaced, the response a counted zero
    # (reward/timeouts).
    timeout_s: float = ranged(10.0, gt=0.0)
    # Styles of reward.functions the user declares safe to run in the trainer's own process: no
    # process hop (microseconds), but no hard timeout either; a raise or a bad value is still a
    # counted zero. Every other user function runs in the pool.
    in_process: list[str] = field(default_factory=list)
    # Characters of a user function's printed output (stdout, stderr) kept per call: the rest is
    # dropped (a function that prints megabytes never floods the trainer's console or disk).
    max_output_chars: int = ranged(2000, ge=0)


@dataclass(kw_only=True)
class RewardConfig(ConfigBase):
    # Processes in the verifier pool (math and code run there; exact_boxed runs in-process).
    num_workers: int = ranged(2, ge=1)
    # Address-space limit of each pool worker in MiB (0 = none): a runaway expression fails there.
    worker_memory_mb: int = ranged(4096, ge=0)
    # Seconds a freshly started worker may take to import its verifiers and report ready.
    worker_start_timeout_s: float = ranged(120.0, gt=0.0)
    # Map a data style or data_source to a registered style, e.g. {"rule": "math",
    # "codecontests": "code"}. The item's style is looked up first, then its data_source.
    style_map: dict[str, str] = field(default_factory=dict)
    # Style used when neither the item's style nor its data_source is known ("" = error).
    default_style: str = ""
    math: MathConfig = field(default_factory=MathConfig)
    code: CodeConfig = field(default_factory=CodeConfig)
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    # Reward styles from the user's own code: {STYLE: "pkg.module:fn" | "path/to/file.py:fn"}; fn(response,
    # ground_truth, extra_info) -> float or {"score": float, ...} (docs/custom_task.md). Checked at
    # start-up (importable, callable, signature); run in the process pool under user.timeout_s.
    functions: dict[str, str] = field(default_factory=dict)
    # The limits of reward.functions.
    user: UserFunctionsConfig = field(default_factory=UserFunctionsConfig)

    def validate(self) -> None:
        super().validate()
        from megatron_rl.common.user_code import UserCodeError, parse_target

        for style, target in self.functions.items():
            try:
                parse_target(target)
            except UserCodeError as exc:
                raise ConfigError(f"{self.key('functions')}.{style}", str(exc)) from None
        for style in self.user.in_process:
            if style not in self.functions:
                self.user.fail("in_process", f"{style!r} is not a style of reward.functions "
                                             f"({sorted(self.functions)})")
