/*
 * Simulated NVML for devbox's tests: a libnvidia-ml.so.1 that nvidia-ml-py loads
 * in place of the driver's, so the binding's own ctypes code runs against GPUs
 * described in a text file. Only the functions devbox calls are exported;
 * calling anything else fails at the binding with "function not found", as on a
 * real driver too old to have it.
 *
 * The file named by $DEVBOX_NVML_SIM holds one GPU per line:
 *     gpu uuid=GPU-0001 name=Simulated_H100 mem_total=85899345920
 * ('_' in a name stands for a space). No file, or a missing variable: the
 * library fails to initialise with NVML_ERROR_LIBRARY_NOT_FOUND, like a
 * machine whose driver is not loaded.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int nvmlReturn_t;
enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_LIBRARY_NOT_FOUND = 12,
    NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_UNKNOWN = 999,
};

#define MAX_GPUS 64
#define FIELD 96

typedef struct sim_gpu {
    char uuid[FIELD];
    char name[FIELD];
    unsigned long long mem_total;
} sim_gpu;

typedef sim_gpu *nvmlDevice_t;

static sim_gpu gpus[MAX_GPUS];
static unsigned int gpu_count;
static int initialised;

static void set_field(sim_gpu *g, const char *key, const char *value) {
    if (strcmp(key, "uuid") == 0) {
        snprintf(g->uuid, FIELD, "%s", value);
    } else if (strcmp(key, "name") == 0) {
        snprintf(g->name, FIELD, "%s", value);
        for (char *c = g->name; *c; c++)
            if (*c == '_') *c = ' ';
    } else if (strcmp(key, "mem_total") == 0) {
        g->mem_total = strtoull(value, NULL, 10);
    }
}

static int load(void) {
    const char *path = getenv("DEVBOX_NVML_SIM");
    if (!path) return -1;
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    char line[1024];
    gpu_count = 0;
    while (fgets(line, sizeof line, f) && gpu_count < MAX_GPUS) {
        if (strncmp(line, "gpu", 3) != 0) continue;
        sim_gpu *g = &gpus[gpu_count];
        memset(g, 0, sizeof *g);
        snprintf(g->uuid, FIELD, "GPU-sim-%04u", gpu_count);
        snprintf(g->name, FIELD, "Simulated GPU");
        char *save = NULL;
        for (char *tok = strtok_r(line + 3, " \t\n", &save); tok; tok = strtok_r(NULL, " \t\n", &save)) {
            char *eq = strchr(tok, '=');
            if (!eq) continue;
            *eq = '\0';
            set_field(g, tok, eq + 1);
        }
        gpu_count++;
    }
    fclose(f);
    return 0;
}

nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    if (load() != 0) return NVML_ERROR_LIBRARY_NOT_FOUND;
    initialised = 1;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }

nvmlReturn_t nvmlShutdown(void) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    initialised = 0;
    return NVML_SUCCESS;
}

const char *nvmlErrorString(nvmlReturn_t result) {
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_LIBRARY_NOT_FOUND: return "NVML Shared Library Not Found";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    default: return "Unknown Error";
    }
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    *count = gpu_count;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
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
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (!device) return NVML_ERROR_INVALID_ARGUMENT;
    return copy_out(device->name, name, length);
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (!device) return NVML_ERROR_INVALID_ARGUMENT;
    return copy_out(device->uuid, uuid, length);
}
