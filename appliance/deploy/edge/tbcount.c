/*
 * tbcount: a QEMU TCG plugin (qemu-user) that counts executed translation blocks and records each
 * block's instruction bytes, in the manner of QEMU's contrib/plugins/hotblocks.c, so that the
 * blocks can be costed offline (benchmarks/arm_cycles.py runs llvm-mca on them).
 *
 *   qemu-aarch64 -plugin ./libtbcount.so,out=blocks.txt PROGRAM ...
 *
 * Output, written when the guest exits to PATH, and to PATH.1, PATH.2, ... each time the guest makes
 * the marker system call lseek(-1, 0x5eed0a11, 0) (an EBADF no-op; the driver calls it around the
 * inferences to count): one line per translated block that has run at least once,
 *   <executions so far> <guest vaddr hex> <instruction bytes hex>
 * so the difference of two snapshots is exactly what ran between the two marks.
 * A block translated again (same or other address) gets a line of its own; the reader sums
 * lines with the same bytes. The execution counter is an inline add (no helper call per block),
 * not atomic: run the guest with one thread for exact counts.
 * Built against include/qemu/qemu-plugin.h of the installed qemu (fetch_header.sh).
 */
#include <glib.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <qemu-plugin.h>

QEMU_PLUGIN_EXPORT int qemu_plugin_version = QEMU_PLUGIN_VERSION;

typedef struct {
    uint64_t count;    /* first: the inline add targets it */
    uint64_t vaddr;
    size_t size;
    unsigned char *bytes;
} Block;

static GMutex lock;
static GPtrArray *blocks;
static char *out_path;

static void vcpu_tb_trans(qemu_plugin_id_t id, struct qemu_plugin_tb *tb)
{
    size_t n = qemu_plugin_tb_n_insns(tb), size = 0, i;
    Block *b = g_new0(Block, 1);
    for (i = 0; i < n; i++) {
        size += qemu_plugin_insn_size(qemu_plugin_tb_get_insn(tb, i));
    }
    b->vaddr = qemu_plugin_tb_vaddr(tb);
    b->size = size;
    b->bytes = g_malloc(size ? size : 1);
    size = 0;
    for (i = 0; i < n; i++) {
        struct qemu_plugin_insn *insn = qemu_plugin_tb_get_insn(tb, i);
        size_t s = qemu_plugin_insn_size(insn);
        memcpy(b->bytes + size, qemu_plugin_insn_data(insn), s);
        size += s;
    }
    g_mutex_lock(&lock);
    g_ptr_array_add(blocks, b);
    g_mutex_unlock(&lock);
    qemu_plugin_register_vcpu_tb_exec_inline(tb, QEMU_PLUGIN_INLINE_ADD_U64, &b->count, 1);
}

#define SYS_LSEEK 62 /* aarch64 */
#define MARK 0x5eed0a11ULL
static int marks;

static void dump(const char *path)
{
    FILE *f = fopen(path, "w");
    guint i;
    size_t j;
    if (f == NULL) {
        fprintf(stderr, "tbcount: cannot write %s\n", path);
        return;
    }
    g_mutex_lock(&lock);
    for (i = 0; i < blocks->len; i++) {
        Block *b = g_ptr_array_index(blocks, i);
        if (b->count == 0) {
            continue;
        }
        fprintf(f, "%" PRIu64 " %" PRIx64 " ", b->count, b->vaddr);
        for (j = 0; j < b->size; j++) {
            fprintf(f, "%02x", b->bytes[j]);
        }
        fputc('\n', f);
    }
    g_mutex_unlock(&lock);
    fclose(f);
}

static void vcpu_syscall(qemu_plugin_id_t id, unsigned int vcpu_index, int64_t num, uint64_t a1,
                         uint64_t a2, uint64_t a3, uint64_t a4, uint64_t a5, uint64_t a6,
                         uint64_t a7, uint64_t a8)
{
    if (num == SYS_LSEEK && a1 == UINT64_MAX && a2 == MARK) {
        char *path = g_strdup_printf("%s.%d", out_path, __atomic_add_fetch(&marks, 1, __ATOMIC_SEQ_CST));
        dump(path);
        g_free(path);
    }
}

static void plugin_exit(qemu_plugin_id_t id, void *p)
{
    dump(out_path);
}

QEMU_PLUGIN_EXPORT int qemu_plugin_install(qemu_plugin_id_t id, const qemu_info_t *info,
                                           int argc, char **argv)
{
    int i;
    for (i = 0; i < argc; i++) {
        if (g_str_has_prefix(argv[i], "out=")) {
            out_path = g_strdup(argv[i] + 4);
        } else {
            fprintf(stderr, "tbcount: unknown option %s (out=PATH)\n", argv[i]);
            return -1;
        }
    }
    if (out_path == NULL) {
        fprintf(stderr, "tbcount: give out=PATH\n");
        return -1;
    }
    blocks = g_ptr_array_new();
    qemu_plugin_register_vcpu_tb_trans_cb(id, vcpu_tb_trans);
    qemu_plugin_register_vcpu_syscall_cb(id, vcpu_syscall);
    qemu_plugin_register_atexit_cb(id, plugin_exit, NULL);
    return 0;
}
