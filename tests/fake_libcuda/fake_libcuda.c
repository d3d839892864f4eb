/*
 * A fake NVIDIA user-space driver for warmctl's tests: the CUDA checkpoint API of libcuda.so.1
 * and the few NVML calls warmctl makes, over a state directory shared by every process that
 * loads it. It is the only test double in warmctl, and it sits exactly at the driver boundary:
 * the real ctypes binding (warmctl/checkpoint/cuda.py, nvml.py) is loaded against it unchanged.
 *
 * Written from NVIDIA's public documentation (CUDA Driver API, "CUDA Checkpointing" group, and
 * the struct references CUcheckpointLockArgs / CheckpointArgs / RestoreArgs / UnlockArgs /
 * GpuPair), not from NVIDIA code. Argument structs are 64 bytes; reserved bytes must be zero
 * (the fake returns CUDA_ERROR_INVALID_VALUE otherwise, so a binding that forgets to zero them
 * fails its tests).
 *
 * State directory: $WARMCTL_FAKE_CUDA_DIR (required; every call fails with
 * CUDA_ERROR_NOT_INITIALIZED without it).
 *   gpus          one line per GPU: "GPU-<uuid> <total_bytes>"; index = line number from 0
 *   procs/<pid>   a CUDA process: "<state> <gpu_index> <bytes> <poisoned>" (state 0..3)
 *   procs/ns-<ino>-<nspid>  the same, written by a process that cannot see its host PID (its
 *                 own PID namespace with its own /proc): <ino> its PID namespace's inode,
 *                 <nspid> its PID there. Renamed to procs/<host pid> at the next lookup, the
 *                 host PID found in this process's /proc, as the real driver knows every
 *                 process by its host PID
 *   control       optional injected behaviour, re-read on every call, one rule a line:
 *                   fail <op> <pid|*> <cuda_error> [<state_after>]
 *                   busy <pid|*> <ms>      lock waits <ms> for outstanding work
 *                   slow <pid|*> <ms>      checkpoint and restore take <ms> (copying memory)
 *                   driver_version <int>   what cuDriverGetVersion returns (default 13000)
 *                 op is one of lock checkpoint restore unlock get_state restore_tid
 *   events        appended "<monotonic_ns> <begin|end> <op> <pid> <rc>" for ordering checks
 *
 * State machine per process (RUNNING=0, LOCKED=1, CHECKPOINTED=2, FAILED=3), as documented:
 *   lock        RUNNING -> LOCKED; on timeout stays RUNNING and returns CUDA_ERROR_TIMEOUT
 *   checkpoint  LOCKED -> CHECKPOINTED (GPU memory released)
 *   restore     CHECKPOINTED -> LOCKED, needs free memory on the target GPU; on
 *               CUDA_ERROR_OUT_OF_MEMORY the process is "poisoned": every later restore
 *               returns CUDA_ERROR_OPERATING_SYSTEM and unlock CUDA_ERROR_ILLEGAL_STATE, as
 *               reported in NVIDIA/cuda-checkpoint#44 (driver 580.95.05)
 *   unlock      LOCKED -> RUNNING
 * Any other transition returns CUDA_ERROR_ILLEGAL_STATE. A pid that is not alive, or has no
 * procs/<pid> file, gets CUDA_ERROR_INVALID_VALUE.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_STUB_LIBRARY = 34,
    CUDA_ERROR_INSUFFICIENT_DRIVER = 35,
    CUDA_ERROR_NO_DEVICE = 100,
    CUDA_ERROR_OPERATING_SYSTEM = 304,
    CUDA_ERROR_ILLEGAL_STATE = 401,
    CUDA_ERROR_NOT_PERMITTED = 800,
    CUDA_ERROR_NOT_SUPPORTED = 801,
    CUDA_ERROR_TIMEOUT = 909,
    CUDA_ERROR_UNKNOWN = 999,
};
enum { RUNNING = 0, LOCKED = 1, CHECKPOINTED = 2, FAILED = 3 };

typedef struct { unsigned char bytes[16]; } CUuuid;
typedef struct { CUuuid oldUuid; CUuuid newUuid; } CUcheckpointGpuPair;
typedef struct { unsigned int timeoutMs; unsigned int reserved0; uint64_t reserved1[7]; } CUcheckpointLockArgs;
typedef struct { uint64_t reserved[8]; } CUcheckpointCheckpointArgs;
typedef struct { CUcheckpointGpuPair *gpuPairs; unsigned int gpuPairsCount; char reserved[52]; } CUcheckpointRestoreArgs;
typedef struct { uint64_t reserved[8]; } CUcheckpointUnlockArgs;

_Static_assert(sizeof(CUcheckpointLockArgs) == 64, "lock args are 64 bytes");
_Static_assert(sizeof(CUcheckpointCheckpointArgs) == 64, "checkpoint args are 64 bytes");
_Static_assert(sizeof(CUcheckpointRestoreArgs) == 64, "restore args are 64 bytes");
_Static_assert(sizeof(CUcheckpointUnlockArgs) == 64, "unlock args are 64 bytes");

#define MAX_GPUS 16

struct proc { int state, gpu; unsigned long long bytes; int poisoned; };
struct gpu { char uuid[64]; unsigned long long total; };

static const char *dir(void) { return getenv("WARMCTL_FAKE_CUDA_DIR"); }

static long long now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void event(const char *what, const char *op, int pid, int rc)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/events", dir());
    int fd = open(path, O_WRONLY | O_APPEND | O_CREAT, 0644);
    if (fd < 0)
        return;
    char line[256];
    int n = snprintf(line, sizeof line, "%lld %s %s %d %d\n", now_ns(), what, op, pid, rc);
    (void)!write(fd, line, n);
    close(fd);
}

/* A global lock over the state directory: operations are atomic with respect to each other. */
static int lock_dir(void)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/.lock", dir());
    int fd = open(path, O_RDWR | O_CREAT, 0644);
    if (fd >= 0)
        flock(fd, LOCK_EX);
    return fd;
}
static void unlock_dir(int fd) { if (fd >= 0) { flock(fd, LOCK_UN); close(fd); } }

static int read_gpus(struct gpu *g)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/gpus", dir());
    FILE *f = fopen(path, "r");
    if (!f)
        return 0;
    int n = 0;
    while (n < MAX_GPUS && fscanf(f, "%63s %llu", g[n].uuid, &g[n].total) == 2)
        n++;
    fclose(f);
    return n;
}

/* The host PID of the process whose PID namespace has inode <ino> and which has PID <nspid>
 * there (the last field of NSpid), or -1. */
static int host_pid_of(unsigned long long ino, int nspid)
{
    DIR *d = opendir("/proc");
    struct dirent *e;
    int found = -1;
    while (found < 0 && d && (e = readdir(d))) {
        int pid = atoi(e->d_name);
        char path[4096], line[512];
        struct stat st;
        if (pid <= 0)
            continue;
        snprintf(path, sizeof path, "/proc/%d/ns/pid", pid);
        if (stat(path, &st) != 0 || (unsigned long long)st.st_ino != ino)
            continue;
        snprintf(path, sizeof path, "/proc/%d/status", pid);
        FILE *f = fopen(path, "r");
        while (f && fgets(line, sizeof line, f)) {
            if (strncmp(line, "NSpid:", 6) != 0)
                continue;
            char *last = strrchr(line, '\t');
            if (last && atoi(last + 1) == nspid)
                found = pid;
            break;
        }
        if (f)
            fclose(f);
    }
    if (d)
        closedir(d);
    return found;
}

/* Rename every procs/ns-<ino>-<nspid> to procs/<host pid> (see the header). */
static void adopt_namespaced(void)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/procs", dir());
    DIR *d = opendir(path);
    struct dirent *e;
    while (d && (e = readdir(d))) {
        unsigned long long ino;
        int nspid, pid;
        if (sscanf(e->d_name, "ns-%llu-%d", &ino, &nspid) != 2 || (pid = host_pid_of(ino, nspid)) < 0)
            continue;
        char from[4096], to[4096];
        snprintf(from, sizeof from, "%s/procs/%s", dir(), e->d_name);
        snprintf(to, sizeof to, "%s/procs/%d", dir(), pid);
        rename(from, to);
    }
    if (d)
        closedir(d);
}

static int read_proc(int pid, struct proc *p)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/procs/%d", dir(), pid);
    FILE *f = fopen(path, "r");
    if (!f) {
        adopt_namespaced();
        f = fopen(path, "r");
    }
    if (!f)
        return -1;
    int ok = fscanf(f, "%d %d %llu %d", &p->state, &p->gpu, &p->bytes, &p->poisoned) == 4;
    fclose(f);
    return ok ? 0 : -1;
}

static void write_proc(int pid, const struct proc *p)
{
    char path[4096], tmp[4096];
    snprintf(path, sizeof path, "%s/procs/%d", dir(), pid);
    snprintf(tmp, sizeof tmp, "%s/procs/.%d.tmp", dir(), pid);
    FILE *f = fopen(tmp, "w");
    if (!f)
        return;
    fprintf(f, "%d %d %llu %d\n", p->state, p->gpu, p->bytes, p->poisoned);
    fclose(f);
    rename(tmp, path);
}

/* GPU memory in use on a GPU: every process whose memory is resident (not CHECKPOINTED). */
static unsigned long long used_on(int gpu)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/procs", dir());
    unsigned long long used = 0;
    adopt_namespaced();
    DIR *d = opendir(path);
    struct dirent *e;
    while (d && (e = readdir(d))) {
        int pid = atoi(e->d_name);
        struct proc p;
        if (pid > 0 && read_proc(pid, &p) == 0 && p.gpu == gpu &&
            (p.state == RUNNING || p.state == LOCKED))
            used += p.bytes;
    }
    if (d)
        closedir(d);
    return used;
}

/* Injected rules. Returns the error to inject for (op, pid), or 0; *state_after = -1 if none. */
static int rule_fail(const char *op, int pid, int *state_after)
{
    char path[4096], line[512];
    *state_after = -1;
    snprintf(path, sizeof path, "%s/control", dir());
    FILE *f = fopen(path, "r");
    if (!f)
        return 0;
    int found = 0;
    while (fgets(line, sizeof line, f)) {
        char kind[32], rop[32], rpid[32];
        int code, st;
        int n = sscanf(line, "%31s %31s %31s %d %d", kind, rop, rpid, &code, &st);
        if (n >= 4 && !strcmp(kind, "fail") && !strcmp(rop, op) &&
            (!strcmp(rpid, "*") || atoi(rpid) == pid)) {
            found = code;
            *state_after = n == 5 ? st : -1;
            break;
        }
    }
    fclose(f);
    return found;
}

static long rule_long(const char *kind, int pid, long dflt)
{
    char path[4096], line[512];
    snprintf(path, sizeof path, "%s/control", dir());
    FILE *f = fopen(path, "r");
    if (!f)
        return dflt;
    long val = dflt;
    while (fgets(line, sizeof line, f)) {
        char k[32], a[32], b[32];
        int n = sscanf(line, "%31s %31s %31s", k, a, b);
        if (strcmp(k, kind))
            continue;
        if (n == 2 && !strcmp(kind, "driver_version"))
            val = atol(a);
        else if (n == 3 && (!strcmp(a, "*") || atoi(a) == pid))
            val = atol(b);
    }
    fclose(f);
    return val;
}

static int alive(int pid) { return pid > 0 && (kill(pid, 0) == 0 || errno == EPERM); }

static int all_zero(const void *p, size_t n)
{
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++)
        if (b[i])
            return 0;
    return 1;
}

static void uuid_to_str(const CUuuid *u, char *out)
{
    const unsigned char *b = u->bytes;
    sprintf(out, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x",
            b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13],
            b[14], b[15]);
}

static int gpu_index(const char *uuid)
{
    struct gpu g[MAX_GPUS];
    int n = read_gpus(g);
    for (int i = 0; i < n; i++)
        if (!strcasecmp(g[i].uuid, uuid))
            return i;
    return -1;
}

/* Common prologue: check the environment, the pid and injected failures. */
#define BEGIN(opname)                                                                              \
    const char *op = opname;                                                                       \
    if (!dir())                                                                                    \
        return CUDA_ERROR_NOT_INITIALIZED;                                                         \
    event("begin", op, pid, 0);                                                                    \
    CUresult rc = CUDA_SUCCESS;                                                                    \
    int lk = lock_dir();                                                                           \
    struct proc p;                                                                                 \
    int st_after;                                                                                  \
    int inj = rule_fail(op, pid, &st_after);                                                       \
    if (!alive(pid) || read_proc(pid, &p) != 0) {                                                  \
        rc = CUDA_ERROR_INVALID_VALUE;                                                             \
        goto out;                                                                                  \
    }                                                                                              \
    if (inj) {                                                                                     \
        rc = inj;                                                                                  \
        if (st_after >= 0) {                                                                       \
            p.state = st_after;                                                                    \
            write_proc(pid, &p);                                                                   \
        }                                                                                          \
        goto out;                                                                                  \
    }

#define END                                                                                        \
    out:                                                                                           \
    unlock_dir(lk);                                                                                \
    event("end", op, pid, rc);                                                                     \
    return rc;

CUresult cuInit(unsigned int flags)
{
    if (flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (!dir())
        return CUDA_ERROR_NO_DEVICE;
    struct gpu g[MAX_GPUS];
    return read_gpus(g) > 0 ? CUDA_SUCCESS : CUDA_ERROR_NO_DEVICE;
}

CUresult cuDriverGetVersion(int *version)
{
    if (!version)
        return CUDA_ERROR_INVALID_VALUE;
    *version = dir() ? (int)rule_long("driver_version", 0, 13000) : 13000;
    return CUDA_SUCCESS;
}

CUresult cuGetErrorName(CUresult e, const char **s)
{
    switch (e) {
    case CUDA_SUCCESS: *s = "CUDA_SUCCESS"; break;
    case CUDA_ERROR_INVALID_VALUE: *s = "CUDA_ERROR_INVALID_VALUE"; break;
    case CUDA_ERROR_OUT_OF_MEMORY: *s = "CUDA_ERROR_OUT_OF_MEMORY"; break;
    case CUDA_ERROR_NOT_INITIALIZED: *s = "CUDA_ERROR_NOT_INITIALIZED"; break;
    case CUDA_ERROR_STUB_LIBRARY: *s = "CUDA_ERROR_STUB_LIBRARY"; break;
    case CUDA_ERROR_INSUFFICIENT_DRIVER: *s = "CUDA_ERROR_INSUFFICIENT_DRIVER"; break;
    case CUDA_ERROR_NO_DEVICE: *s = "CUDA_ERROR_NO_DEVICE"; break;
    case CUDA_ERROR_OPERATING_SYSTEM: *s = "CUDA_ERROR_OPERATING_SYSTEM"; break;
    case CUDA_ERROR_ILLEGAL_STATE: *s = "CUDA_ERROR_ILLEGAL_STATE"; break;
    case CUDA_ERROR_NOT_PERMITTED: *s = "CUDA_ERROR_NOT_PERMITTED"; break;
    case CUDA_ERROR_NOT_SUPPORTED: *s = "CUDA_ERROR_NOT_SUPPORTED"; break;
    case CUDA_ERROR_TIMEOUT: *s = "CUDA_ERROR_TIMEOUT"; break;
    case CUDA_ERROR_UNKNOWN: *s = "CUDA_ERROR_UNKNOWN"; break;
    default: *s = NULL; return CUDA_ERROR_INVALID_VALUE;
    }
    return CUDA_SUCCESS;
}

CUresult cuGetErrorString(CUresult e, const char **s)
{
    switch (e) {
    case CUDA_SUCCESS: *s = "no error"; break;
    case CUDA_ERROR_INVALID_VALUE: *s = "invalid argument"; break;
    case CUDA_ERROR_OUT_OF_MEMORY: *s = "out of memory"; break;
    case CUDA_ERROR_NOT_INITIALIZED: *s = "initialization error"; break;
    case CUDA_ERROR_STUB_LIBRARY: *s = "CUDA driver is a stub library"; break;
    case CUDA_ERROR_INSUFFICIENT_DRIVER: *s = "CUDA driver version is insufficient for CUDA runtime version"; break;
    case CUDA_ERROR_NO_DEVICE: *s = "no CUDA-capable device is detected"; break;
    case CUDA_ERROR_OPERATING_SYSTEM: *s = "OS call failed or operation not supported on this OS"; break;
    case CUDA_ERROR_ILLEGAL_STATE: *s = "the operation cannot be performed in the present state"; break;
    case CUDA_ERROR_NOT_PERMITTED: *s = "operation not permitted"; break;
    case CUDA_ERROR_NOT_SUPPORTED: *s = "operation not supported"; break;
    case CUDA_ERROR_TIMEOUT: *s = "the operation timed out"; break;
    case CUDA_ERROR_UNKNOWN: *s = "unknown error"; break;
    default: *s = NULL; return CUDA_ERROR_INVALID_VALUE;
    }
    return CUDA_SUCCESS;
}

#ifndef FAKE_NO_CHECKPOINT_API

CUresult cuCheckpointProcessGetState(int pid, int *state)
{
    BEGIN("get_state");
    if (!state) { rc = CUDA_ERROR_INVALID_VALUE; goto out; }
    *state = p.state;
    END
}

CUresult cuCheckpointProcessGetRestoreThreadId(int pid, int *tid)
{
    BEGIN("restore_tid");
    if (!tid) { rc = CUDA_ERROR_INVALID_VALUE; goto out; }
    *tid = pid;
    END
}

CUresult cuCheckpointProcessLock(int pid, CUcheckpointLockArgs *args)
{
    BEGIN("lock");
    if (args && (args->reserved0 || !all_zero(args->reserved1, sizeof args->reserved1))) {
        rc = CUDA_ERROR_INVALID_VALUE;
        goto out;
    }
    if (p.state != RUNNING) { rc = CUDA_ERROR_ILLEGAL_STATE; goto out; }
    long busy_ms = rule_long("busy", pid, 0);
    unsigned timeout = args ? args->timeoutMs : 0;
    /* Outstanding work must finish before the lock is taken; the directory lock is released
     * meanwhile so that other processes can be locked in parallel. */
    unlock_dir(lk);
    if (timeout && busy_ms > (long)timeout) {
        usleep(timeout * 1000UL);
        lk = lock_dir();
        rc = CUDA_ERROR_TIMEOUT; /* documented: the process is left RUNNING */
        goto out;
    }
    usleep(busy_ms * 1000UL);
    lk = lock_dir();
    if (read_proc(pid, &p) != 0 || p.state != RUNNING) { rc = CUDA_ERROR_ILLEGAL_STATE; goto out; }
    p.state = LOCKED;
    write_proc(pid, &p);
    END
}

static void slow(int pid)
{
    long ms = dir() ? rule_long("slow", pid, 0) : 0;
    if (ms > 0)
        usleep(ms * 1000UL);
}

CUresult cuCheckpointProcessCheckpoint(int pid, CUcheckpointCheckpointArgs *args)
{
    slow(pid);
    BEGIN("checkpoint");
    if (args && !all_zero(args, sizeof *args)) { rc = CUDA_ERROR_INVALID_VALUE; goto out; }
    if (p.state != LOCKED) { rc = CUDA_ERROR_ILLEGAL_STATE; goto out; }
    p.state = CHECKPOINTED;
    write_proc(pid, &p);
    END
}

CUresult cuCheckpointProcessRestore(int pid, CUcheckpointRestoreArgs *args)
{
    slow(pid);
    BEGIN("restore");
    if (args && !all_zero(args->reserved, sizeof args->reserved)) { rc = CUDA_ERROR_INVALID_VALUE; goto out; }
    if (p.state != CHECKPOINTED) { rc = CUDA_ERROR_ILLEGAL_STATE; goto out; }
    if (p.poisoned) { rc = CUDA_ERROR_OPERATING_SYSTEM; goto out; }
    int target = p.gpu;
    if (args && args->gpuPairsCount) {
        /* GPU remapping exists from driver 580 (CUDA 13.0); older drivers see a non-zero
         * reserved field. The map must contain every checkpointed GPU (driver API doc). */
        if (rule_long("driver_version", 0, 13000) < 13000 || !args->gpuPairs) {
            rc = CUDA_ERROR_INVALID_VALUE;
            goto out;
        }
        struct gpu g[MAX_GPUS];
        int n = read_gpus(g), found = 0;
        for (unsigned i = 0; i < args->gpuPairsCount; i++) {
            char olds[64], news[64];
            uuid_to_str(&args->gpuPairs[i].oldUuid, olds);
            uuid_to_str(&args->gpuPairs[i].newUuid, news);
            int oi = gpu_index(olds), ni = gpu_index(news);
            if (ni < 0 || ni >= n) { rc = CUDA_ERROR_INVALID_VALUE; goto out; }
            if (oi == p.gpu) { target = ni; found = 1; }
        }
        if (!found) { rc = CUDA_ERROR_INVALID_VALUE; goto out; }
    }
    struct gpu g[MAX_GPUS];
    int n = read_gpus(g);
    if (target < 0 || target >= n) { rc = CUDA_ERROR_INVALID_VALUE; goto out; }
    if (used_on(target) + p.bytes > g[target].total) {
        p.poisoned = 1; /* NVIDIA/cuda-checkpoint#44: a failed restore is not rolled back */
        write_proc(pid, &p);
        rc = CUDA_ERROR_OUT_OF_MEMORY;
        goto out;
    }
    p.gpu = target;
    p.state = LOCKED;
    write_proc(pid, &p);
    END
}

CUresult cuCheckpointProcessUnlock(int pid, CUcheckpointUnlockArgs *args)
{
    BEGIN("unlock");
    if (args && !all_zero(args, sizeof *args)) { rc = CUDA_ERROR_INVALID_VALUE; goto out; }
    if (p.state != LOCKED || p.poisoned) { rc = CUDA_ERROR_ILLEGAL_STATE; goto out; }
    p.state = RUNNING;
    write_proc(pid, &p);
    END
}

#endif /* FAKE_NO_CHECKPOINT_API */

/* ---- NVML (libnvidia-ml.so.1): the subset warmctl calls ---- */

typedef int nvmlReturn_t;
enum { NVML_SUCCESS = 0, NVML_ERROR_UNINITIALIZED = 1, NVML_ERROR_INVALID_ARGUMENT = 2,
       NVML_ERROR_INSUFFICIENT_SIZE = 7, NVML_ERROR_DRIVER_NOT_LOADED = 9 };
typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
typedef struct { unsigned int pid; unsigned long long usedGpuMemory; unsigned int gpuInstanceId, computeInstanceId; } nvmlProcessInfo_t;

nvmlReturn_t nvmlInit_v2(void) { return dir() ? NVML_SUCCESS : NVML_ERROR_DRIVER_NOT_LOADED; }
nvmlReturn_t nvmlShutdown(void) { return NVML_SUCCESS; }

nvmlReturn_t nvmlSystemGetDriverVersion(char *out, unsigned int len)
{
    long v = rule_long("driver_version", 0, 13000);
    snprintf(out, len, "%s", v >= 13000 ? "580.65.06" : v >= 12080 ? "570.86.10" : "550.54.15");
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count)
{
    struct gpu g[MAX_GPUS];
    *count = (unsigned)read_gpus(g);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, void **handle)
{
    struct gpu g[MAX_GPUS];
    if ((int)index >= read_gpus(g))
        return NVML_ERROR_INVALID_ARGUMENT;
    *handle = (void *)(uintptr_t)(index + 1);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetUUID(void *handle, char *uuid, unsigned int len)
{
    struct gpu g[MAX_GPUS];
    int i = (int)(uintptr_t)handle - 1, n = read_gpus(g);
    if (i < 0 || i >= n)
        return NVML_ERROR_INVALID_ARGUMENT;
    snprintf(uuid, len, "%s", g[i].uuid);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(void *handle, nvmlMemory_t *mem)
{
    struct gpu g[MAX_GPUS];
    int i = (int)(uintptr_t)handle - 1, n = read_gpus(g);
    if (i < 0 || i >= n)
        return NVML_ERROR_INVALID_ARGUMENT;
    int lk = lock_dir();
    mem->total = g[i].total;
    mem->used = used_on(i);
    mem->free = mem->used > mem->total ? 0 : mem->total - mem->used;
    unlock_dir(lk);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(void *handle, unsigned int *count, nvmlProcessInfo_t *infos)
{
    int gi = (int)(uintptr_t)handle - 1;
    char path[4096];
    snprintf(path, sizeof path, "%s/procs", dir());
    unsigned n = 0, cap = *count;
    int lk = lock_dir();
    adopt_namespaced();
    DIR *d = opendir(path);
    struct dirent *e;
    while (d && (e = readdir(d))) {
        int pid = atoi(e->d_name);
        struct proc p;
        if (pid <= 0 || !alive(pid) || read_proc(pid, &p) != 0 || p.gpu != gi ||
            !(p.state == RUNNING || p.state == LOCKED))
            continue;
        if (infos && n < cap) {
            infos[n].pid = (unsigned)pid;
            infos[n].usedGpuMemory = p.bytes;
            infos[n].gpuInstanceId = infos[n].computeInstanceId = 0xFFFFFFFFu;
        }
        n++;
    }
    if (d)
        closedir(d);
    unlock_dir(lk);
    *count = n;
    return n > cap ? NVML_ERROR_INSUFFICIENT_SIZE : NVML_SUCCESS;
}
