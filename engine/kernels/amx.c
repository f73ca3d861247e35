/* Linux's permission for the AMX tile state (amx.h). */
#define _GNU_SOURCE /* syscall() */
#include "amx.h"

#if defined(__linux__) && defined(__x86_64__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

int tm_internal_amx_permitted(void) {
#if defined(__linux__) && defined(__x86_64__)
    static int state; /* 0: not asked yet, 1: granted, -1: refused */
    int seen;
#pragma omp atomic read
    seen = state;
    if (seen == 0) {
        const long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
        seen = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
#pragma omp atomic write
        state = seen;
    }
    return seen > 0;
#else
    return 0;
#endif
}
