/* A VM of a box's own, on the box's /dev/kvm, through the KVM API alone: one vCPU in
 * real mode running a few bytes of code that write to port 0x3f8.
 *
 *   kvm_guest            the guest writes "KVM\n" and halts; this prints it, exits 0
 *   kvm_guest loop FILE  the guest writes forever; every 1000 writes the count so far
 *                        replaces FILE (atomically), until this process is killed
 *
 * Exit status 2 and a line on stderr name the step that failed. Static, no libc
 * beyond the syscalls: it runs in any image. */
#include <errno.h>
#include <fcntl.h>
#include <linux/kvm.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <unistd.h>

static int fail(const char *step)
{
    perror(step);
    return 2;
}

int main(int argc, char **argv)
{
    /* mov dx,0x3f8; mov al,'K'; out dx,al; mov al,'V'; out; mov al,'M'; out; mov al,10; out; hlt */
    static const uint8_t hello[] = {0xba, 0xf8, 0x03, 0xb0, 'K', 0xee, 0xb0, 'V', 0xee,
                                    0xb0, 'M',  0xee, 0xb0, '\n', 0xee, 0xf4};
    /* mov dx,0x3f8; again: mov al,'.'; out dx,al; jmp again */
    static const uint8_t forever[] = {0xba, 0xf8, 0x03, 0xb0, '.', 0xee, 0xeb, 0xfb};
    int loop = argc == 3 && strcmp(argv[1], "loop") == 0;
    const uint8_t *code = loop ? forever : hello;
    size_t code_len = loop ? sizeof(forever) : sizeof(hello);

    int kvm = open("/dev/kvm", O_RDWR | O_CLOEXEC);
    if (kvm < 0) {
        return fail("open /dev/kvm");
    }
    if (ioctl(kvm, KVM_GET_API_VERSION, 0) != KVM_API_VERSION) {
        return fail("KVM_GET_API_VERSION");
    }
    int vm = ioctl(kvm, KVM_CREATE_VM, 0);
    if (vm < 0) {
        return fail("KVM_CREATE_VM");
    }
    uint8_t *mem = mmap(NULL, 0x1000, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (mem == MAP_FAILED) {
        return fail("mmap guest memory");
    }
    memcpy(mem, code, code_len);
    struct kvm_userspace_memory_region region = {
        .slot = 0, .guest_phys_addr = 0x1000, .memory_size = 0x1000, .userspace_addr = (uint64_t)mem};
    if (ioctl(vm, KVM_SET_USER_MEMORY_REGION, &region) < 0) {
        return fail("KVM_SET_USER_MEMORY_REGION");
    }
    int vcpu = ioctl(vm, KVM_CREATE_VCPU, 0);
    if (vcpu < 0) {
        return fail("KVM_CREATE_VCPU");
    }
    int run_size = ioctl(kvm, KVM_GET_VCPU_MMAP_SIZE, 0);
    struct kvm_run *run = run_size > 0 ? mmap(NULL, run_size, PROT_READ | PROT_WRITE, MAP_SHARED, vcpu, 0)
                                       : MAP_FAILED;
    if (run == MAP_FAILED) {
        return fail("mmap kvm_run");
    }
    struct kvm_sregs sregs;
    if (ioctl(vcpu, KVM_GET_SREGS, &sregs) < 0) {
        return fail("KVM_GET_SREGS");
    }
    sregs.cs.base = 0;
    sregs.cs.selector = 0;
    if (ioctl(vcpu, KVM_SET_SREGS, &sregs) < 0) {
        return fail("KVM_SET_SREGS");
    }
    struct kvm_regs regs = {.rip = 0x1000, .rflags = 0x2};
    if (ioctl(vcpu, KVM_SET_REGS, &regs) < 0) {
        return fail("KVM_SET_REGS");
    }
    unsigned long long writes = 0;
    for (;;) {
        if (ioctl(vcpu, KVM_RUN, 0) < 0) {
            if (errno == EINTR) { /* a signal, or the freezer (a save of the box): run on */
                continue;
            }
            return fail("KVM_RUN");
        }
        switch (run->exit_reason) {
        case KVM_EXIT_HLT:
            return 0;
        case KVM_EXIT_IO:
            if (run->io.direction != KVM_EXIT_IO_OUT || run->io.port != 0x3f8) {
                fprintf(stderr, "unexpected I/O at port 0x%x\n", run->io.port);
                return 2;
            }
            if (!loop) {
                putchar(*((char *)run + run->io.data_offset));
                fflush(stdout);
            } else if (++writes % 1000 == 0) {
                /* written aside, then renamed over FILE: a reader never sees it empty
                 * (a truncate-and-write read between the two gave a count of 0) */
                char tmp[4096];
                snprintf(tmp, sizeof(tmp), "%s.tmp", argv[2]);
                FILE *f = fopen(tmp, "w");
                if (f) {
                    fprintf(f, "%llu\n", writes);
                    if (fclose(f) == 0) {
                        rename(tmp, argv[2]);
                    }
                }
            }
            break;
        default:
            fprintf(stderr, "unexpected exit reason %u\n", run->exit_reason);
            return 2;
        }
    }
}
