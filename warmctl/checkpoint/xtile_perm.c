/*
 * criu-xtile-perm.so: loaded into `criu restore` with LD_PRELOAD by warmctl
 * (warmctl/checkpoint/criu.py, restore_env) on hosts whose kernel offers AMX tile data.
 *
 * Why: on x86 CPUs with AMX (Sapphire Rapids and later) a process must ask the kernel for
 * permission to use the tile registers, arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA),
 * before its first AMX instruction; oneDNN and vLLM's CPU kernels do that once per process.
 * The permission is kernel state, not memory: CRIU 4.2 does not dump it, so a restored engine
 * has lost it, and its next AMX instruction kills the worker with SIGILL (measured: a restored
 * `tiny` engine's VllmWorker died "exit code -4" at the canary's first request; a dumped and
 * restored Python process read ARCH_GET_XCOMP_PERM 0x600e7 before and 0x200e7 after).
 *
 * The permission is inherited by fork() and cleared by execve(): so this constructor asks for
 * it inside the criu process itself, before CRIU forks the tasks it restores, and every
 * restored task inherits it. On a CPU or kernel without AMX the request fails and nothing
 * changes (errors are ignored on purpose; warmctl only preloads it where the kernel offers
 * the feature, see criu.py).
 *
 * Built by scripts/install.sh: cc -shared -fPIC -O2 -o /usr/local/lib/warmctl/criu-xtile-perm.so
 */
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023 /* arch/x86/include/uapi/asm/prctl.h */
#define XFEATURE_XTILEDATA 18      /* arch/x86/include/asm/fpu/types.h */

__attribute__((constructor)) static void warmctl_request_xtiledata(void)
{
	(void)syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA);
}
