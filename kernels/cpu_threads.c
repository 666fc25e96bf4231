/* Where the OpenMP threads of a decode step run (Linux).
 *
 * When the step's threads are as many as the CPUs, any other work (the front process, a client on the
 * same machine) takes a CPU from them for a while. Left to the scheduler, the thread that wakes for the
 * next parallel region is then often queued on the CPU of the thread that woke it, and the two take
 * turns on one CPU while the other runs the foreign work: each in turn spins at the region's barrier,
 * holding the CPU its partner needs (perf sched showed ~0.75 ms turns). One session's step, in
 * process, beside a process that burns 5 ms of CPU every ~100 ms: each ms of that CPU made the step
 * 2.0-2.2 ms later; with each thread on a CPU of its own, 1.0-1.1 ms (docs/kernels.md).
 *
 *   bind_threads(cpus, n)   OpenMP thread i of a team of n (torch's team: one runtime, one pool of
 *                           threads) runs on cpus[i] only, from now on; 0, or -1 where the team was
 *                           not n threads or a thread could not be bound (some may be) */
#define _GNU_SOURCE
#include <omp.h>
#include <sched.h>

int bind_threads(const int *cpus, int n) {
    int failed = 0;
#pragma omp parallel num_threads(n) reduction(| : failed)
    {
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(cpus[omp_get_thread_num()], &set);
        failed = omp_get_num_threads() != n || sched_setaffinity(0, sizeof set, &set) != 0;
    }
    return failed ? -1 : 0;
}
