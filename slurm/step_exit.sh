# The exit code of an srun step, from srun's own line per task (sourced by job.sh; it needs no SLURM, so the
# tests source it directly).
#
# srun exits with 128 + the highest signal any task died of, above every task's own exit code. With
# --kill-on-bad-exit, the first task to end non-zero gets the others SIGTERMed and a second later SIGKILLed, so
# a preempted step (one task exits 75, its peers are killed while they exit too) ends 137, and so does a step
# whose first task aborted (SIGABRT is 6, less than 9: NCCL's watchdog ends a rank with std::abort) or raised an
# error (exit 1). srun's lines tell them apart: `srun: error: node1: task 1: Aborted (core dumped)`,
# `srun: error: node2: tasks 0-1: Exited with exit code 75`, `srun: error: node1: task 0: Killed`.

# crashes by srun's name for the signal (strsignal), " (core dumped)" cut: 128 + N, as a shell reports them
declare -A CRASH_CODES=([Aborted]=134 ["Segmentation fault"]=139 ["Bus error"]=135
                        ["Floating point exception"]=136 ["Illegal instruction"]=132)

# `step_exit_code RC LINES_FILE MODULE [FORWARDED]`: prints the step's code, from srun's code RC and srun's lines;
# FORWARDED: srun's name of the preemption signal job.sh passed on to the step ("User defined signal 1"), if any:
#   - a task that died of FORWARDED had not installed its handler yet (the interpreter's start-up: the jobs install
#     it first thing), so it had nothing to save: preempted, as if it exited 75;
#   - a task that crashed (died of any other signal but srun's own TERM and KILL): 128 + N, never 75, and one line
#     on stderr naming the task and the signal;
#   - else a task's own code other than 75 (1 error, 2 usage, 3 diverged), the first listed;
#   - else 75 if a task exited 75 (preempted: every rank passed the checkpoint's last barrier before any exits);
#   - else RC.
step_exit_code() {
  local rc=$1 lines=$2 module=$3 forwarded=${4:-} line tasks what crashed="" own="" preempted=""
  while IFS= read -r line; do
    [[ $line =~ ^srun:\ error:\ [^\ ]+:\ (tasks?\ [0-9,-]+):\ (.+)$ ]] || continue
    tasks=${BASH_REMATCH[1]} what=${BASH_REMATCH[2]}
    case $what in
      "Exited with exit code $EXIT_PREEMPTED") preempted=1 ;;
      "Exited with exit code "*) own=${own:-${what##* }} ;;
      Killed | Terminated) ;;  # --kill-on-bad-exit ending the others
      "$forwarded") preempted=1 ;;  # still starting: no handler yet, nothing to save
      *) if [ -z "$crashed" ]; then
           crashed=$what
           echo "$module: $tasks crashed ($what): not a preemption, not requeued" >&2
         fi ;;
    esac
  done < "$lines"
  if [ -n "$crashed" ]; then
    what=${crashed% (core dumped)}
    echo "${CRASH_CODES[$what]:-$(( rc > 128 ? rc : 1 ))}"
  elif [ -n "$own" ]; then
    echo "$own"
  elif [ -n "$preempted" ]; then
    echo "$EXIT_PREEMPTED"
  else
    echo "$rc"
  fi
}
