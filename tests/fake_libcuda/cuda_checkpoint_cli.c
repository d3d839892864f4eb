/*
 * A stand-in for NVIDIA's `cuda-checkpoint` utility, built on the fake libcuda in this folder,
 * so that warmctl's fallback path (driver without the checkpoint symbols) runs in tests.
 *
 * Command line and output follow the utility's documented interface (NVIDIA/cuda-checkpoint
 * README, and its 580.65.06 --help quoted in NVIDIA/cuda-checkpoint#18):
 *   --get-state --pid P              prints running | locked | checkpointed | failed
 *   --get-restore-tid --pid P        prints the thread id
 *   --action lock|checkpoint|restore|unlock --pid P [--timeout MS] [--device-map old=new,...]
 * On failure it prints  Could not <action> on process ID <pid>: "<cuGetErrorString>"  and
 * exits 1 (message format as quoted in NVIDIA/cuda-checkpoint#35).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef struct { unsigned char bytes[16]; } CUuuid;
typedef struct { CUuuid oldUuid; CUuuid newUuid; } CUcheckpointGpuPair;
typedef struct { unsigned int timeoutMs; unsigned int reserved0; uint64_t reserved1[7]; } CUcheckpointLockArgs;
typedef struct { CUcheckpointGpuPair *gpuPairs; unsigned int gpuPairsCount; char reserved[52]; } CUcheckpointRestoreArgs;

CUresult cuCheckpointProcessGetState(int, int *);
CUresult cuCheckpointProcessGetRestoreThreadId(int, int *);
CUresult cuCheckpointProcessLock(int, CUcheckpointLockArgs *);
CUresult cuCheckpointProcessCheckpoint(int, void *);
CUresult cuCheckpointProcessRestore(int, CUcheckpointRestoreArgs *);
CUresult cuCheckpointProcessUnlock(int, void *);
CUresult cuGetErrorString(CUresult, const char **);

static int parse_uuid(const char *s, CUuuid *u)
{
    if (strncmp(s, "GPU-", 4) == 0)
        s += 4;
    int n = 0;
    while (*s && n < 16) {
        if (*s == '-') { s++; continue; }
        unsigned v;
        if (sscanf(s, "%2x", &v) != 1)
            return -1;
        u->bytes[n++] = (unsigned char)v;
        s += 2;
    }
    return n == 16 ? 0 : -1;
}

static int fail(const char *action, int pid, CUresult rc)
{
    const char *msg = "unknown error";
    cuGetErrorString(rc, &msg);
    fprintf(stderr, "Could not %s on process ID %d: \"%s\"\n", action, pid, msg ? msg : "unknown error");
    return 1;
}

int main(int argc, char **argv)
{
    const char *action = NULL, *map = NULL;
    int pid = -1, get_state = 0, get_tid = 0;
    unsigned timeout = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--get-state")) get_state = 1;
        else if (!strcmp(argv[i], "--get-restore-tid")) get_tid = 1;
        else if (!strcmp(argv[i], "--action") && i + 1 < argc) action = argv[++i];
        else if ((!strcmp(argv[i], "--pid") || !strcmp(argv[i], "-p")) && i + 1 < argc) pid = atoi(argv[++i]);
        else if ((!strcmp(argv[i], "--timeout") || !strcmp(argv[i], "-t")) && i + 1 < argc) timeout = (unsigned)atoi(argv[++i]);
        else if ((!strcmp(argv[i], "--device-map") || !strcmp(argv[i], "-d")) && i + 1 < argc) map = argv[++i];
        else if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            printf("CUDA checkpoint and restore utility (warmctl test stand-in).\n"
                   "--get-state --pid <pid>\n--get-restore-tid --pid <pid>\n"
                   "--action lock | checkpoint | restore | unlock --pid <pid> [--timeout <ms>] [--device-map <uuids>]\n");
            return 0;
        } else {
            fprintf(stderr, "unknown argument %s\n", argv[i]);
            return 2;
        }
    }
    if (pid < 0) { fprintf(stderr, "--pid is required\n"); return 2; }
    CUresult rc;
    if (get_state) {
        int st = -1;
        if ((rc = cuCheckpointProcessGetState(pid, &st)))
            return fail("get state", pid, rc);
        static const char *names[] = {"running", "locked", "checkpointed", "failed"};
        printf("%s\n", st >= 0 && st < 4 ? names[st] : "unknown");
        return 0;
    }
    if (get_tid) {
        int tid = 0;
        if ((rc = cuCheckpointProcessGetRestoreThreadId(pid, &tid)))
            return fail("get restore tid", pid, rc);
        printf("%d\n", tid);
        return 0;
    }
    if (!action) { fprintf(stderr, "no operation\n"); return 2; }
    if (!strcmp(action, "lock")) {
        CUcheckpointLockArgs a;
        memset(&a, 0, sizeof a);
        a.timeoutMs = timeout;
        rc = cuCheckpointProcessLock(pid, &a);
    } else if (!strcmp(action, "checkpoint")) {
        uint64_t a[8] = {0};
        rc = cuCheckpointProcessCheckpoint(pid, a);
    } else if (!strcmp(action, "unlock")) {
        uint64_t a[8] = {0};
        rc = cuCheckpointProcessUnlock(pid, a);
    } else if (!strcmp(action, "restore")) {
        CUcheckpointRestoreArgs a;
        CUcheckpointGpuPair pairs[16];
        memset(&a, 0, sizeof a);
        memset(pairs, 0, sizeof pairs);
        unsigned n = 0;
        if (map) {
            char *copy = strdup(map), *save = NULL;
            for (char *tok = strtok_r(copy, ",", &save); tok && n < 16; tok = strtok_r(NULL, ",", &save)) {
                char *eq = strchr(tok, '=');
                if (!eq) { free(copy); fprintf(stderr, "bad --device-map\n"); return 2; }
                *eq = 0;
                if (parse_uuid(tok, &pairs[n].oldUuid) || parse_uuid(eq + 1, &pairs[n].newUuid)) {
                    free(copy); fprintf(stderr, "bad --device-map\n"); return 2;
                }
                n++;
            }
            free(copy);
            a.gpuPairs = pairs;
            a.gpuPairsCount = n;
        }
        rc = cuCheckpointProcessRestore(pid, &a);
    } else {
        fprintf(stderr, "unknown action %s\n", action);
        return 2;
    }
    return rc ? fail(action, pid, rc) : 0;
}
