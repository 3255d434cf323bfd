/*
 * Simulated NVML for devbox's tests: a libnvidia-ml.so.1 that nvidia-ml-py loads
 * in place of the driver's, so the binding's own ctypes code runs against GPUs
 * described in a text file. Only the functions devbox calls are exported;
 * calling anything else fails at the binding with "function not found", as on a
 * real driver too old to have it.
 *
 * The file named by $DEVBOX_NVML_SIM holds one GPU per line, in index order:
 *     gpu uuid=GPU-0001 name=Simulated_H100 mem_total=85899345920 mem_used=1024
 *         util=40 mem_util=10 power_mw=300000 power_limit_mw=700000 temp=61
 *         sm_clock=1980 pcie_tx=1000 pcie_rx=2000 ecc_corrected=1
 *         ecc_uncorrected=0 minor=3 unsupported=power,temp lost=1
 * ('_' in a name stands for a space; every key is optional; minor defaults to
 * the index, numbers to 0) and one line per process on a GPU:
 *     proc gpu=0 pid=1234 mem=1073741824 kind=compute sm=55 memutil=20 ts=1000000
 * (no mem: NVML's "not available" value; kind: compute or graphics; ts: the
 * microsecond timestamp of the process's utilisation sample, 0 = no sample).
 *
 * unsupported= names calls that answer NVML_ERROR_NOT_SUPPORTED: util (both
 * utilisation rates), mem, power, power_limit, temp, sm_clock, pcie, ecc, minor,
 * compute, graphics, proc_util. lost=1: every call on that GPU answers
 * NVML_ERROR_GPU_IS_LOST.
 *
 * Tests rewrite the file while a reader runs (atomically: a new file renamed
 * over the old), so every device call stats it and reloads when it changed;
 * handles point into a fixed array, so they survive a reload. No file, or a
 * missing variable: the library fails to initialise with
 * NVML_ERROR_LIBRARY_NOT_FOUND, like a machine whose driver is not loaded.
 */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

typedef int nvmlReturn_t;
enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_LIBRARY_NOT_FOUND = 12,
    NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_UNKNOWN = 999,
};

/* The enum values the binding passes (nvml.h). */
enum { NVML_TEMPERATURE_GPU = 0 };
enum { NVML_CLOCK_SM = 1 };
enum { NVML_PCIE_UTIL_TX_BYTES = 0, NVML_PCIE_UTIL_RX_BYTES = 1 };
enum { NVML_MEMORY_ERROR_TYPE_CORRECTED = 0, NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1 };
enum { NVML_VOLATILE_ECC = 0 };

/* The structs the binding allocates, laid out as in nvml.h. */
typedef struct {
    unsigned int gpu;
    unsigned int memory;
} nvmlUtilization_t;

typedef struct {
    unsigned long long total;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_t;

typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlProcessInfo_t;

typedef struct {
    unsigned int pid;
    unsigned long long timeStamp;
    unsigned int smUtil;
    unsigned int memUtil;
    unsigned int encUtil;
    unsigned int decUtil;
} nvmlProcessUtilizationSample_t;

#define NVML_VALUE_NOT_AVAILABLE ULLONG_MAX
#define NO_INSTANCE 0xFFFFFFFFu /* gpuInstanceId/computeInstanceId outside MIG */

#define MAX_GPUS 64
#define MAX_PROCS 4096
#define FIELD 96

enum metric {
    M_UTIL = 1 << 0,
    M_MEM = 1 << 1,
    M_POWER = 1 << 2,
    M_POWER_LIMIT = 1 << 3,
    M_TEMP = 1 << 4,
    M_SM_CLOCK = 1 << 5,
    M_PCIE = 1 << 6,
    M_ECC = 1 << 7,
    M_MINOR = 1 << 8,
    M_COMPUTE = 1 << 9,
    M_GRAPHICS = 1 << 10,
    M_PROC_UTIL = 1 << 11,
};

static const struct {
    const char *name;
    unsigned bit;
} metric_names[] = {
    {"util", M_UTIL},           {"mem", M_MEM},         {"power", M_POWER},
    {"power_limit", M_POWER_LIMIT}, {"temp", M_TEMP},   {"sm_clock", M_SM_CLOCK},
    {"pcie", M_PCIE},           {"ecc", M_ECC},         {"minor", M_MINOR},
    {"compute", M_COMPUTE},     {"graphics", M_GRAPHICS}, {"proc_util", M_PROC_UTIL},
};

typedef struct sim_gpu {
    char uuid[FIELD];
    char name[FIELD];
    unsigned long long mem_total, mem_used, ecc_corrected, ecc_uncorrected;
    unsigned int util, mem_util, power_mw, power_limit_mw, temp, sm_clock;
    unsigned int pcie_tx, pcie_rx, minor;
    unsigned unsupported;
    int lost;
} sim_gpu;

typedef struct sim_proc {
    unsigned int gpu, pid, sm, memutil;
    int graphics;
    unsigned long long mem, ts;
} sim_proc;

typedef sim_gpu *nvmlDevice_t;

static sim_gpu gpus[MAX_GPUS];
static unsigned int gpu_count;
static sim_proc procs[MAX_PROCS];
static unsigned int proc_count;
static int init_count; /* nvmlInit/nvmlShutdown nest, as in the real library */
static struct stat loaded; /* the file as last read: reload when it differs */

static unsigned long long number(const char *value) { return strtoull(value, NULL, 10); }

static unsigned parse_unsupported(const char *value) {
    char list[256];
    snprintf(list, sizeof list, "%s", value);
    unsigned bits = 0;
    char *save = NULL;
    for (char *name = strtok_r(list, ",", &save); name; name = strtok_r(NULL, ",", &save))
        for (size_t i = 0; i < sizeof metric_names / sizeof metric_names[0]; i++)
            if (strcmp(name, metric_names[i].name) == 0) bits |= metric_names[i].bit;
    return bits;
}

static void set_gpu_field(sim_gpu *g, const char *key, const char *value) {
    if (strcmp(key, "uuid") == 0) {
        snprintf(g->uuid, FIELD, "%s", value);
    } else if (strcmp(key, "name") == 0) {
        snprintf(g->name, FIELD, "%s", value);
        for (char *c = g->name; *c; c++)
            if (*c == '_') *c = ' ';
    } else if (strcmp(key, "mem_total") == 0) g->mem_total = number(value);
    else if (strcmp(key, "mem_used") == 0) g->mem_used = number(value);
    else if (strcmp(key, "util") == 0) g->util = number(value);
    else if (strcmp(key, "mem_util") == 0) g->mem_util = number(value);
    else if (strcmp(key, "power_mw") == 0) g->power_mw = number(value);
    else if (strcmp(key, "power_limit_mw") == 0) g->power_limit_mw = number(value);
    else if (strcmp(key, "temp") == 0) g->temp = number(value);
    else if (strcmp(key, "sm_clock") == 0) g->sm_clock = number(value);
    else if (strcmp(key, "pcie_tx") == 0) g->pcie_tx = number(value);
    else if (strcmp(key, "pcie_rx") == 0) g->pcie_rx = number(value);
    else if (strcmp(key, "ecc_corrected") == 0) g->ecc_corrected = number(value);
    else if (strcmp(key, "ecc_uncorrected") == 0) g->ecc_uncorrected = number(value);
    else if (strcmp(key, "minor") == 0) g->minor = number(value);
    else if (strcmp(key, "unsupported") == 0) g->unsupported = parse_unsupported(value);
    else if (strcmp(key, "lost") == 0) g->lost = number(value) != 0;
}

static void set_proc_field(sim_proc *p, const char *key, const char *value) {
    if (strcmp(key, "gpu") == 0) p->gpu = number(value);
    else if (strcmp(key, "pid") == 0) p->pid = number(value);
    else if (strcmp(key, "mem") == 0) p->mem = number(value);
    else if (strcmp(key, "kind") == 0) p->graphics = strcmp(value, "graphics") == 0;
    else if (strcmp(key, "sm") == 0) p->sm = number(value);
    else if (strcmp(key, "memutil") == 0) p->memutil = number(value);
    else if (strcmp(key, "ts") == 0) p->ts = number(value);
}

/* Calls set(record, key, value) for each key=value word of line. */
#define PARSE_WORDS(line, record, set)                                                    \
    do {                                                                                  \
        char *save = NULL;                                                                \
        for (char *tok = strtok_r(line, " \t\n", &save); tok; tok = strtok_r(NULL, " \t\n", &save)) { \
            char *eq = strchr(tok, '=');                                                  \
            if (!eq) continue;                                                            \
            *eq = '\0';                                                                   \
            set(record, tok, eq + 1);                                                     \
        }                                                                                 \
    } while (0)

static int load(void) {
    const char *path = getenv("DEVBOX_NVML_SIM");
    if (!path) return -1;
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    if (fstat(fileno(f), &loaded) != 0) memset(&loaded, 0, sizeof loaded);
    char line[1024];
    gpu_count = 0;
    proc_count = 0;
    while (fgets(line, sizeof line, f)) {
        if (strncmp(line, "gpu ", 4) == 0 && gpu_count < MAX_GPUS) {
            sim_gpu *g = &gpus[gpu_count];
            memset(g, 0, sizeof *g);
            snprintf(g->uuid, FIELD, "GPU-sim-%04u", gpu_count);
            snprintf(g->name, FIELD, "Simulated GPU");
            g->minor = gpu_count;
            PARSE_WORDS(line + 4, g, set_gpu_field);
            gpu_count++;
        } else if (strncmp(line, "proc ", 5) == 0 && proc_count < MAX_PROCS) {
            sim_proc *p = &procs[proc_count];
            memset(p, 0, sizeof *p);
            p->mem = NVML_VALUE_NOT_AVAILABLE;
            PARSE_WORDS(line + 5, p, set_proc_field);
            proc_count++;
        }
    }
    fclose(f);
    return 0;
}

/* A stat per call (under a microsecond) costs a 10 Hz reader of 8 GPUs about 0.1 ms a tick. */
static void reload_if_changed(void) {
    const char *path = getenv("DEVBOX_NVML_SIM");
    struct stat now;
    if (!path || stat(path, &now) != 0) return; /* gone mid-run: keep the last GPUs */
    if (now.st_ino != loaded.st_ino || now.st_size != loaded.st_size ||
        now.st_mtim.tv_sec != loaded.st_mtim.tv_sec || now.st_mtim.tv_nsec != loaded.st_mtim.tv_nsec)
        load();
}

/* The common prologue of every per-device call. */
static nvmlReturn_t check(nvmlDevice_t device, unsigned metric) {
    if (!init_count) return NVML_ERROR_UNINITIALIZED;
    if (!device) return NVML_ERROR_INVALID_ARGUMENT;
    reload_if_changed();
    /* A GPU that left the file is gone, as a GPU that fell off the bus. */
    if (device->lost || (unsigned int)(device - gpus) >= gpu_count) return NVML_ERROR_GPU_IS_LOST;
    if (device->unsupported & metric) return NVML_ERROR_NOT_SUPPORTED;
    return NVML_SUCCESS;
}

#define CHECK(device, metric)                              \
    do {                                                   \
        nvmlReturn_t checked = check(device, metric);      \
        if (checked != NVML_SUCCESS) return checked;       \
    } while (0)

nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    if (load() != 0) return NVML_ERROR_LIBRARY_NOT_FOUND;
    init_count++;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }

nvmlReturn_t nvmlShutdown(void) {
    if (!init_count) return NVML_ERROR_UNINITIALIZED;
    init_count--;
    return NVML_SUCCESS;
}

const char *nvmlErrorString(nvmlReturn_t result) {
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_LIBRARY_NOT_FOUND: return "NVML Shared Library Not Found";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    default: return "Unknown Error";
    }
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    if (!init_count) return NVML_ERROR_UNINITIALIZED;
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    reload_if_changed();
    *count = gpu_count;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    if (!init_count) return NVML_ERROR_UNINITIALIZED;
    reload_if_changed();
    if (!device || index >= gpu_count) return NVML_ERROR_INVALID_ARGUMENT;
    *device = &gpus[index];
    return NVML_SUCCESS;
}

static nvmlReturn_t copy_out(const char *value, char *out, unsigned int length) {
    if (!out) return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(value) + 1 > length) return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(out, value, strlen(value) + 1);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length) {
    CHECK(device, 0);
    return copy_out(device->name, name, length);
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
    CHECK(device, 0);
    return copy_out(device->uuid, uuid, length);
}

nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t device, unsigned int *minor) {
    CHECK(device, M_MINOR);
    if (!minor) return NVML_ERROR_INVALID_ARGUMENT;
    *minor = device->minor;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t *utilization) {
    CHECK(device, M_UTIL);
    if (!utilization) return NVML_ERROR_INVALID_ARGUMENT;
    utilization->gpu = device->util;
    utilization->memory = device->mem_util;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    CHECK(device, M_MEM);
    if (!memory) return NVML_ERROR_INVALID_ARGUMENT;
    memory->total = device->mem_total;
    memory->used = device->mem_used;
    memory->free = device->mem_total > device->mem_used ? device->mem_total - device->mem_used : 0;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t device, unsigned int *power) {
    CHECK(device, M_POWER);
    if (!power) return NVML_ERROR_INVALID_ARGUMENT;
    *power = device->power_mw;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetEnforcedPowerLimit(nvmlDevice_t device, unsigned int *limit) {
    CHECK(device, M_POWER_LIMIT);
    if (!limit) return NVML_ERROR_INVALID_ARGUMENT;
    *limit = device->power_limit_mw;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t device, int sensor, unsigned int *temp) {
    CHECK(device, M_TEMP);
    if (sensor != NVML_TEMPERATURE_GPU || !temp) return NVML_ERROR_INVALID_ARGUMENT;
    *temp = device->temp;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetClockInfo(nvmlDevice_t device, int type, unsigned int *clock) {
    CHECK(device, M_SM_CLOCK);
    /* Only the SM clock is simulated; the others are "not supported" on this GPU. */
    if (!clock) return NVML_ERROR_INVALID_ARGUMENT;
    if (type != NVML_CLOCK_SM) return NVML_ERROR_NOT_SUPPORTED;
    *clock = device->sm_clock;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPcieThroughput(nvmlDevice_t device, int counter, unsigned int *value) {
    CHECK(device, M_PCIE);
    if (!value) return NVML_ERROR_INVALID_ARGUMENT;
    if (counter == NVML_PCIE_UTIL_TX_BYTES) *value = device->pcie_tx;
    else if (counter == NVML_PCIE_UTIL_RX_BYTES) *value = device->pcie_rx;
    else return NVML_ERROR_INVALID_ARGUMENT;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t device, int error_type, int counter_type,
                                         unsigned long long *count) {
    CHECK(device, M_ECC);
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    /* Only the volatile (since boot) counters are simulated. */
    if (counter_type != NVML_VOLATILE_ECC) return NVML_ERROR_NOT_SUPPORTED;
    if (error_type == NVML_MEMORY_ERROR_TYPE_CORRECTED) *count = device->ecc_corrected;
    else if (error_type == NVML_MEMORY_ERROR_TYPE_UNCORRECTED) *count = device->ecc_uncorrected;
    else return NVML_ERROR_INVALID_ARGUMENT;
    return NVML_SUCCESS;
}

/* NVML's two-call protocol: a too-small buffer (NULL on the first call) gets the
 * count needed and NVML_ERROR_INSUFFICIENT_SIZE. */
static nvmlReturn_t running_processes(nvmlDevice_t device, int graphics, unsigned int *count,
                                      nvmlProcessInfo_t *infos) {
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned int index = (unsigned int)(device - gpus), needed = 0;
    for (unsigned int i = 0; i < proc_count; i++)
        if (procs[i].gpu == index && procs[i].graphics == graphics) needed++;
    if (needed > *count || (needed && !infos)) {
        *count = needed;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    unsigned int n = 0;
    for (unsigned int i = 0; i < proc_count; i++) {
        const sim_proc *p = &procs[i];
        if (p->gpu != index || p->graphics != graphics) continue;
        infos[n].pid = p->pid;
        infos[n].usedGpuMemory = p->mem;
        infos[n].gpuInstanceId = NO_INSTANCE;
        infos[n].computeInstanceId = NO_INSTANCE;
        n++;
    }
    *count = n;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *count,
                                                     nvmlProcessInfo_t *infos) {
    CHECK(device, M_COMPUTE);
    return running_processes(device, 0, count, infos);
}

nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v3(nvmlDevice_t device, unsigned int *count,
                                                      nvmlProcessInfo_t *infos) {
    CHECK(device, M_GRAPHICS);
    return running_processes(device, 1, count, infos);
}

/* Samples newer than last_seen only; none at all is NVML_ERROR_NOT_FOUND. */
nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t device,
                                             nvmlProcessUtilizationSample_t *samples,
                                             unsigned int *count, unsigned long long last_seen) {
    CHECK(device, M_PROC_UTIL);
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned int index = (unsigned int)(device - gpus), needed = 0;
    for (unsigned int i = 0; i < proc_count; i++)
        if (procs[i].gpu == index && procs[i].ts > last_seen) needed++;
    if (!needed) return NVML_ERROR_NOT_FOUND;
    if (needed > *count || !samples) {
        *count = needed;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    unsigned int n = 0;
    for (unsigned int i = 0; i < proc_count; i++) {
        const sim_proc *p = &procs[i];
        if (p->gpu != index || p->ts <= last_seen) continue;
        samples[n] = (nvmlProcessUtilizationSample_t){
            .pid = p->pid, .timeStamp = p->ts, .smUtil = p->sm, .memUtil = p->memutil};
        n++;
    }
    *count = n;
    return NVML_SUCCESS;
}

/* Calls the agent does not make but the peers in benchmarks/bench_telemetry.py (gpustat,
 * nvitop) do, so that they run against the same simulated GPUs. */
nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index) {
    CHECK(device, 0);
    if (!index) return NVML_ERROR_INVALID_ARGUMENT;
    *index = (unsigned int)(device - gpus);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    if (!init_count) return NVML_ERROR_UNINITIALIZED;
    return copy_out("sim", version, length);
}
