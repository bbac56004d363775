/* detdata.storage._fileread: the batched local-shard read loop without the interpreter.
 *
 * read_shards(prefix, names, shards, file_at, wants, out, iov_off, iov_len, iov_count, stats,
 *             threads=1, state=None, ident=None, sizes=None)
 *
 * For i in 0..n-1: open(prefix + names[shards[i]]) (through the prefix's folder, opened
 * once per call and thread: see open_folder), ONE preadv of wants[i] bytes at
 * file_at[i] into iov_count[i] consecutive buffers (out + iov_off[j], iov_len[j]), fstat
 * AFTER the read, close. stats[i] = (bytes read, st_size, st_ino, st_dev, st_mtime_ns) as
 * raw 64-bit patterns. Runs without the GIL, on up to `threads` (at most 2) threads, each
 * taking a contiguous share of at least 16 files (system calls on small files cost more
 * than their copies: two threads read a batch of many small shards ~1.6x faster).
 *
 * Returns the number of shards fully read: it stops, with nothing recorded for shard i,
 * at the first shard whose open, read or fstat fails, whose read is short, whose path is
 * too long or whose buffer count exceeds IOV_MAX. The caller (detdata.storage.fileread)
 * checks the shards read and handles shard i onward with the plain Python loop, which
 * raises the exact error the loop would. Arguments that do not fit each other (a buffer
 * outside `out`, a shard index outside `names`, arrays of the wrong length) raise
 * ValueError before any file is opened.
 *
 * With a first-open table (state, ident, sizes: see detdata.storage.first_opens), a shard
 * whose state is not "recorded" is fstat'ed right after its open and BEFORE its read: a
 * file of the expected size is recorded as the shard's first file (claim_first: one
 * thread records, the others see its record); one of another size stops the loop there,
 * before its read (the caller's loop raises the exact error).
 *
 * record_firsts (below): the same records made from Python.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#ifndef IOV_MAX
#define IOV_MAX 1024
#endif

typedef struct {
    Py_buffer view;
    int held;
} held_buffer;

/* Element types a buffer must hold: ANY_BYTES, or native int64, uint64 or uint8. */
enum { ANY_BYTES = 0, INT64 = 'i', UINT64 = 'u', UINT8 = 'b' };

static int holds(const Py_buffer *v, int type) {
    if (type == ANY_BYTES) {
        return 1;
    }
    const char *f = v->format != NULL ? v->format : "B";
    while (*f == '@' || *f == '='
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
           || *f == '<'
#endif
    ) {
        f++;
    }
    if (f[0] == '\0' || f[1] != '\0') {
        return 0;
    }
    switch (type) {
    case INT64:
        return v->itemsize == 8 && (f[0] == 'q' || f[0] == 'l');
    case UINT64:
        return v->itemsize == 8 && (f[0] == 'Q' || f[0] == 'L');
    default:
        return v->itemsize == 1 && f[0] == 'B';
    }
}

/* A contiguous buffer of `obj` (writable if asked) holding elements of `type`; -1 with a
 * ValueError naming `who` and `what` otherwise. */
static int take(PyObject *obj, held_buffer *b, int writable, int type, const char *who,
                const char *what) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, &b->view, flags) < 0) {
        PyErr_Format(PyExc_ValueError, "%s: %s must be a contiguous %sbuffer", who, what,
                     writable ? "writable " : "");
        return -1;
    }
    b->held = 1;
    if (!holds(&b->view, type)) {
        static const char *names[] = {"int64", "uint64", "uint8"};
        const char *want = names[type == INT64 ? 0 : type == UINT64 ? 1 : 2];
        PyErr_Format(PyExc_ValueError,
                     "%s: %s must hold native %s (got format '%s', %zd-byte items)", who, what,
                     want, b->view.format != NULL ? b->view.format : "B", b->view.itemsize);
        return -1;
    }
    return 0;
}

static void release(held_buffer *b) {
    if (b->held) {
        PyBuffer_Release(&b->view);
        b->held = 0;
    }
}

/* A file's identity: (inode, device, mtime_ns) as unsigned 64-bit patterns. */
static void identity_of(const struct stat *st, uint64_t now[3]) {
    now[0] = (uint64_t)st->st_ino;
    now[1] = (uint64_t)st->st_dev;
    now[2] = (uint64_t)st->st_mtim.tv_sec * 1000000000ULL + (uint64_t)st->st_mtim.tv_nsec;
}

static void put_stat(const struct stat *st, int64_t *at) {
    uint64_t ident[3];
    identity_of(st, ident);
    at[0] = (int64_t)st->st_size;
    for (int i = 0; i < 3; i++) {
        at[1 + i] = (int64_t)ident[i];
    }
}

#ifndef O_PATH
#define O_PATH O_RDONLY
#endif

/* The folder `prefix` names (a path ending in '/'), opened for openat (O_PATH: search
 * permission is enough), or -1: each file is then opened by its whole path. Opened once
 * per loop (per thread's share) and closed at its end, never kept: a folder replaced
 * between two loops is seen by the next one, as opens by path see it. Opening the files
 * through it spares the kernel a walk of the prefix's components per file (measured
 * outside benchmarks/: ~7% of this loop's cost per 8 KiB shard at 50k shards). */
static int open_folder(const char *prefix, size_t plen) {
    if (plen == 0 || prefix[plen - 1] != '/') {
        return -1;
    }
    return open(prefix, O_PATH | O_DIRECTORY | O_CLOEXEC);
}

/* The file prefix + name (`path`): through the prefix's folder `folder` when it is open
 * and `name` is relative (an absolute name would be opened outside it), else by `path`. */
static int open_file(int folder, const char *name, const char *path) {
    if (folder >= 0 && name[0] != '/') {
        return openat(folder, name, O_RDONLY | O_CLOEXEC);
    }
    return open(path, O_RDONLY | O_CLOEXEC);
}

/* A first-open table (detdata.storage.first_opens): per shard a state byte (0: no record,
 * 2: being recorded, 1: recorded) and its identity (inode, device, mtime_ns); `sizes` the
 * manifest's byte sizes. NULL state: no table (nothing recorded). */
typedef struct {
    unsigned char *state;
    uint64_t *ident;
    const int64_t *sizes;
} firsts_t;

enum { FIRST_NONE = 0, FIRST_RECORDED = 1, FIRST_BUSY = 2 };

/* Record `now` as shard s's first file unless another is recorded (or being recorded: wait
 * for it); `seen` gets the identity recorded. Safe from any number of threads at once,
 * with or without the GIL: a state byte goes 0 -> 2 (claimed by one thread, compare and
 * swap) -> 1 (its identity written before, release order). */
static void claim_first(const firsts_t *f, int64_t s, const uint64_t now[3], uint64_t seen[3]) {
    unsigned char *state = &f->state[s];
    uint64_t *ident = f->ident + 3 * s;
    unsigned char st = __atomic_load_n(state, __ATOMIC_ACQUIRE);
    if (st == FIRST_NONE) {
        unsigned char expected = FIRST_NONE;
        if (__atomic_compare_exchange_n(state, &expected, FIRST_BUSY, 0, __ATOMIC_ACQ_REL,
                                        __ATOMIC_ACQUIRE)) {
            memcpy(ident, now, 3 * sizeof(uint64_t));
            __atomic_store_n(state, FIRST_RECORDED, __ATOMIC_RELEASE);
            memcpy(seen, now, 3 * sizeof(uint64_t));
            return;
        }
        st = expected;
    }
    while (st != FIRST_RECORDED) { /* another thread is between its claim and its store */
        sched_yield();
        st = __atomic_load_n(state, __ATOMIC_ACQUIRE);
    }
    memcpy(seen, ident, 3 * sizeof(uint64_t));
}

/* Shard s's first open (descriptor fd), recorded before any of its bytes are read when the
 * table has no record yet: -1 (nothing recorded) when it cannot be fstat'ed or its size is
 * not the manifest's. */
static int record_open(const firsts_t *f, int64_t s, int fd) {
    if (f->state == NULL || __atomic_load_n(&f->state[s], __ATOMIC_ACQUIRE) == FIRST_RECORDED) {
        return 0;
    }
    struct stat st;
    if (fstat(fd, &st) != 0 || (int64_t)st.st_size != f->sizes[s]) {
        return -1;
    }
    uint64_t now[3], seen[3];
    identity_of(&st, now);
    claim_first(f, s, now, seen); /* another file recorded first: the check after the read
                                     names it (its fstat is not the recorded file's) */
    return 0;
}

static int read_one(int folder, const char *name, const char *path, const firsts_t *f,
                    int64_t shard, int64_t at, int64_t want, struct iovec *iov, int k,
                    int64_t *row) {
    int fd = open_file(folder, name, path);
    if (fd < 0) {
        return -1;
    }
    if (record_open(f, shard, fd) < 0) {
        close(fd);
        return -1;
    }
    ssize_t got = preadv(fd, iov, k, (off_t)at);
    struct stat st;
    int ok = got == (ssize_t)want && fstat(fd, &st) == 0;
    close(fd);
    if (!ok) {
        return -1;
    }
    row[0] = (int64_t)got;
    put_stat(&st, row + 1);
    return 0;
}

/* One thread's share: files [begin, end), their buffers from iov_begin on. */
typedef struct {
    const char *prefix;
    size_t plen;
    const char **paths; /* per file i (not per shard) */
    const size_t *lens; /* strlen of paths[i] unless it holds a NUL byte */
    const int64_t *shards, *file_at, *wants, *iov_off, *iov_len, *iov_count;
    firsts_t first;
    char *out;
    int64_t *stats;
    Py_ssize_t begin, end, iov_begin;
    Py_ssize_t finished; /* out: files [begin, finished) read whole */
} job_t;

static void *run_job(void *arg) {
    job_t *job = arg;
    struct iovec iov[IOV_MAX];
    char path[PATH_MAX];
    int folder = job->begin < job->end ? open_folder(job->prefix, job->plen) : -1;
    Py_ssize_t j = job->iov_begin, i = job->begin;
    for (; i < job->end; i++) {
        Py_ssize_t k = job->iov_count[i];
        size_t nlen = job->lens[i];
        /* a NUL inside a name would open another file: the caller's loop raises instead */
        if (k > IOV_MAX || job->plen + nlen + 1 > sizeof(path) ||
            memchr(job->paths[i], 0, nlen) != NULL) {
            break;
        }
        memcpy(path, job->prefix, job->plen);
        memcpy(path + job->plen, job->paths[i], nlen + 1);
        for (Py_ssize_t m = 0; m < k; m++) {
            iov[m].iov_base = job->out + job->iov_off[j + m];
            iov[m].iov_len = (size_t)job->iov_len[j + m];
        }
        if (read_one(folder, job->paths[i], path, &job->first, job->shards[i], job->file_at[i],
                     job->wants[i], iov, (int)k, job->stats + 5 * i) < 0) {
            break;
        }
        j += k;
    }
    if (folder >= 0) {
        close(folder);
    }
    job->finished = i;
    return NULL;
}

/* Files [0, n) split into up to MAX_THREADS contiguous shares (at least
 * MIN_FILES_PER_THREAD files each); returns the number of shares. */
#define MAX_THREADS 2
#define MIN_FILES_PER_THREAD 16
static int split_jobs(const job_t *base, Py_ssize_t n, int threads, job_t *jobs) {
    if (threads > MAX_THREADS) {
        threads = MAX_THREADS;
    }
    if (n < (Py_ssize_t)threads * MIN_FILES_PER_THREAD) {
        threads = (int)(n / MIN_FILES_PER_THREAD) > 0 ? (int)(n / MIN_FILES_PER_THREAD) : 1;
    }
    Py_ssize_t iov_at = 0, at = 0;
    for (int t = 0; t < threads; t++) {
        jobs[t] = *base;
        jobs[t].begin = at;
        jobs[t].end = t == threads - 1 ? n : at + n / threads;
        jobs[t].iov_begin = iov_at;
        jobs[t].finished = 0;
        for (Py_ssize_t i = jobs[t].begin; i < jobs[t].end; i++) {
            iov_at += base->iov_count[i];
        }
        at = jobs[t].end;
    }
    return threads;
}

/* The files read whole from 0 on: the first share that stopped early ends the count (a
 * later share's reads are then not counted; the caller's loop reads those files again). */
static Py_ssize_t files_finished(const job_t *jobs, int threads, Py_ssize_t n) {
    for (int t = 0; t < threads; t++) {
        if (jobs[t].finished < jobs[t].end) {
            return jobs[t].finished;
        }
    }
    return n;
}

/* All shares, the calling thread taking the first (a share whose thread could not be
 * started is read here too). */
static Py_ssize_t run_jobs(const job_t *base, Py_ssize_t n, int threads) {
    job_t jobs[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    threads = split_jobs(base, n, threads, jobs);
    for (int t = 1; t < threads; t++) {
        started[t] = pthread_create(&ids[t], NULL, run_job, &jobs[t]) == 0;
    }
    run_job(&jobs[0]);
    for (int t = 1; t < threads; t++) {
        if (started[t]) {
            pthread_join(ids[t], NULL);
        } else {
            run_job(&jobs[t]);
        }
    }
    return files_finished(jobs, threads, n);
}

/* References to the names a loop reads: another thread may change `names` while the loop
 * runs without the GIL, so each name read is owned until the loop ends. */
typedef struct {
    PyObject **held;
    const char **paths; /* per file i (not per shard) */
    size_t *lens;
    Py_ssize_t nheld;
} name_refs;

/* Own names[shards[i]] for i in 0..n-1, pointing paths[i] / lens[i] at its bytes; -1 with
 * a ValueError (naming `who`) for an index outside `names` or a name that is not bytes. */
static int hold_names(PyObject *names, const int64_t *shards, Py_ssize_t n, name_refs *r,
                      const char *who) {
    size_t count = (size_t)(n > 0 ? n : 1);
    r->held = PyMem_Malloc((count + 1) * sizeof(PyObject *)); /* + the prefix (prepare_call) */
    r->paths = PyMem_Malloc(count * sizeof(char *));
    r->lens = PyMem_Malloc(count * sizeof(size_t));
    if (r->held == NULL || r->paths == NULL || r->lens == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (shards[i] < 0 || shards[i] >= PyList_GET_SIZE(names)) {
            PyErr_Format(PyExc_ValueError, "%s: shard index out of range", who);
            return -1;
        }
        PyObject *name = PyList_GET_ITEM(names, shards[i]);
        if (!PyBytes_Check(name)) {
            PyErr_Format(PyExc_ValueError, "%s: names must be bytes", who);
            return -1;
        }
        Py_INCREF(name);
        r->held[r->nheld++] = name;
        r->paths[i] = PyBytes_AS_STRING(name);
        r->lens[i] = (size_t)PyBytes_GET_SIZE(name);
    }
    return 0;
}

static void drop_names(name_refs *r) {
    for (Py_ssize_t i = 0; i < r->nheld; i++) {
        Py_DECREF(r->held[i]);
    }
    PyMem_Free(r->held);
    PyMem_Free(r->paths);
    PyMem_Free(r->lens);
}

/* One read_shards call's arguments, held (buffers and names) until `drop_call`. */
#define CALL_BUFFERS 11
typedef struct {
    held_buffer b[CALL_BUFFERS];
    name_refs refs;
    job_t base;
    Py_ssize_t n;
    int threads;
} call_t;

static void drop_call(call_t *c) {
    drop_names(&c->refs);
    for (int i = 0; i < CALL_BUFFERS; i++) {
        release(&c->b[i]);
    }
}

/* The optional first-open table (state, ident, sizes; all three or None): held in `b`,
 * checked against the shard indices read; -1 with a ValueError. */
static int prepare_firsts(PyObject **objs, held_buffer *b, const int64_t *shards, Py_ssize_t n,
                          firsts_t *first, const char *who) {
    int given = 0;
    for (int i = 0; i < 3; i++) {
        given += objs[i] != NULL && objs[i] != Py_None;
    }
    if (given == 0) {
        return 0;
    }
    if (given != 3) {
        PyErr_Format(PyExc_ValueError, "%s: state, ident and sizes go together", who);
        return -1;
    }
    static const char *what[3] = {"state", "ident", "sizes"};
    static const int writable[3] = {1, 1, 0};
    static const int type[3] = {UINT8, UINT64, INT64};
    for (int i = 0; i < 3; i++) {
        if (take(objs[i], &b[i], writable[i], type[i], who, what[i]) < 0) {
            return -1;
        }
    }
    Py_ssize_t count = b[0].view.len;
    if (b[1].view.len / 24 != count || b[2].view.len / 8 != count) {
        PyErr_Format(PyExc_ValueError, "%s: state, ident and sizes of mismatched lengths", who);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (shards[i] >= count) {
            PyErr_Format(PyExc_ValueError, "%s: shard index outside the first-open table", who);
            return -1;
        }
    }
    first->state = b[0].view.buf;
    first->ident = b[1].view.buf;
    first->sizes = b[2].view.buf;
    return 0;
}

/* Parse and check read_shards' arguments into `c` (zeroed by the caller); -1 with an
 * exception set (what was taken is dropped by the caller's `drop_call`). */
static int prepare_call(PyObject *args, call_t *c, const char *who) {
    PyObject *prefix_obj, *names, *objs[CALL_BUFFERS] = {NULL};
    int threads = 1;
    if (!PyArg_ParseTuple(args, "O!O!OOOOOOOO|iOOO", &PyBytes_Type, &prefix_obj, &PyList_Type,
                          &names, &objs[0], &objs[1], &objs[2], &objs[3], &objs[4], &objs[5],
                          &objs[6], &objs[7], &threads, &objs[8], &objs[9], &objs[10])) {
        return -1;
    }
    static const char *what[8] = {"shards", "file_at", "wants", "out",
                                  "iov_off", "iov_len", "iov_count", "stats"};
    static const int writable[8] = {0, 0, 0, 1, 0, 0, 0, 1};
    static const int type[8] = {INT64, INT64, INT64, ANY_BYTES, INT64, INT64, INT64, INT64};
    held_buffer *b = c->b;
    for (int i = 0; i < 8; i++) {
        if (take(objs[i], &b[i], writable[i], type[i], who, what[i]) < 0) {
            return -1;
        }
    }
    Py_ssize_t n = b[0].view.len / 8;
    Py_ssize_t niov = b[4].view.len / 8;
    if (b[1].view.len / 8 != n || b[2].view.len / 8 != n || b[6].view.len / 8 != n ||
        b[5].view.len / 8 != niov || b[7].view.len / 8 < 5 * n) {
        PyErr_Format(PyExc_ValueError, "%s: arrays of mismatched lengths", who);
        return -1;
    }
    const int64_t *shards = b[0].view.buf, *file_at = b[1].view.buf, *wants = b[2].view.buf;
    const int64_t *iov_off = b[4].view.buf, *iov_len = b[5].view.buf, *iov_count = b[6].view.buf;
    Py_ssize_t out_len = b[3].view.len, nnames = PyList_GET_SIZE(names);
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (shards[i] < 0 || shards[i] >= nnames || iov_count[i] < 0 || wants[i] < 0 ||
            file_at[i] < 0 || iov_count[i] > niov - total) {
            PyErr_Format(PyExc_ValueError,
                         "%s: shard index or count out of range (or iov_count does not add "
                         "up to the buffers)",
                         who);
            return -1;
        }
        total += iov_count[i]; /* <= niov: no overflow */
    }
    firsts_t first = {NULL, NULL, NULL};
    if (prepare_firsts(objs + 8, b + 8, shards, n, &first, who) < 0) {
        return -1;
    }
    if (total != niov) {
        PyErr_Format(PyExc_ValueError, "%s: iov_count does not add up to the buffers", who);
        return -1;
    }
    for (Py_ssize_t j = 0; j < niov; j++) {
        if (iov_off[j] < 0 || iov_len[j] < 0 || iov_off[j] > out_len ||
            iov_len[j] > out_len - iov_off[j]) {
            PyErr_Format(PyExc_ValueError, "%s: a buffer lies outside `out`", who);
            return -1;
        }
    }
    if (hold_names(names, shards, n, &c->refs, who) < 0) {
        return -1;
    }
    if (threads < 1) {
        PyErr_Format(PyExc_ValueError, "%s: threads must be >= 1", who);
        return -1;
    }
    if (memchr(PyBytes_AS_STRING(prefix_obj), 0, (size_t)PyBytes_GET_SIZE(prefix_obj)) != NULL) {
        n = 0; /* a NUL in the root: nothing is read here, the caller's loop raises */
    }
    /* the prefix bytes are owned by the caller's argument tuple; held here as a name */
    Py_INCREF(prefix_obj);
    c->refs.held[c->refs.nheld++] = prefix_obj;
    job_t base = {
        .prefix = PyBytes_AS_STRING(prefix_obj),
        .plen = (size_t)PyBytes_GET_SIZE(prefix_obj),
        .paths = c->refs.paths,
        .shards = shards,
        .first = first,
        .lens = c->refs.lens,
        .file_at = file_at,
        .wants = wants,
        .iov_off = iov_off,
        .iov_len = iov_len,
        .iov_count = iov_count,
        .out = b[3].view.buf,
        .stats = b[7].view.buf,
    };
    c->base = base;
    c->n = n;
    c->threads = threads;
    return 0;
}

static PyObject *read_shards(PyObject *self, PyObject *args) {
    (void)self;
    call_t c;
    memset(&c, 0, sizeof(c));
    PyObject *result = NULL;
    if (prepare_call(args, &c, "read_shards") == 0) {
        Py_ssize_t finished = 0;
        Py_BEGIN_ALLOW_THREADS
        finished = run_jobs(&c.base, c.n, c.threads);
        Py_END_ALLOW_THREADS
        result = PyLong_FromSsize_t(finished);
    }
    drop_call(&c);
    return result;
}

/* start_read_shards(...same arguments as read_shards...) -> NativeRead
 *
 * The same reads on threads of their own (every share, the caller's thread takes none):
 * returns at once; NativeRead.wait() joins them (without the GIL) and returns the files
 * read whole from 0 on, as read_shards would. Until then the buffers and names stay held
 * and the caller must not touch `out` or `stats`. A share whose thread cannot be started
 * is read by start_read_shards itself (without the GIL). In a process forked while reads
 * ran, wait() joins nothing (those threads do not exist there) and returns 0: nothing
 * counts as read, the caller's loop reads again. Dropping a NativeRead not waited for
 * joins its threads first. */
typedef struct {
    PyObject_HEAD
    call_t call;
    job_t jobs[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS];
    int threads;
    pid_t pid;
    int state; /* 0: reading, 1: being waited for, 2: done (joined, arguments dropped) */
    Py_ssize_t finished;
} pending_t;

static void pending_join(pending_t *p) {
    /* the GIL is released by the caller */
    for (int t = 0; t < p->threads; t++) {
        if (p->started[t]) {
            pthread_join(p->ids[t], NULL);
            p->started[t] = 0;
        }
    }
}

static PyObject *pending_wait(PyObject *obj, PyObject *unused) {
    (void)unused;
    pending_t *p = (pending_t *)obj;
    if (p->state == 1) {
        PyErr_SetString(PyExc_RuntimeError, "NativeRead.wait: already being waited for");
        return NULL;
    }
    if (p->state == 0) {
        p->state = 1;
        if (p->pid == getpid()) {
            Py_BEGIN_ALLOW_THREADS
            pending_join(p);
            Py_END_ALLOW_THREADS
            p->finished = files_finished(p->jobs, p->threads, p->call.n);
        } else {
            p->finished = 0; /* forked meanwhile: the reads' threads are not in this process */
        }
        drop_call(&p->call);
        p->state = 2;
    }
    return PyLong_FromSsize_t(p->finished);
}

static void pending_dealloc(PyObject *obj) {
    pending_t *p = (pending_t *)obj;
    if (p->state == 0) {
        if (p->pid == getpid()) {
            Py_BEGIN_ALLOW_THREADS
            pending_join(p);
            Py_END_ALLOW_THREADS
        }
        drop_call(&p->call);
        p->state = 2;
    }
    Py_TYPE(obj)->tp_free(obj);
}

static PyMethodDef pending_methods[] = {
    {"wait", pending_wait, METH_NOARGS,
     "wait() -> shards fully read (joins the reads; see start_read_shards)"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject PendingType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "detdata.storage._fileread.NativeRead",
    .tp_basicsize = sizeof(pending_t),
    .tp_dealloc = pending_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Reads started by start_read_shards; wait() joins them.",
    .tp_methods = pending_methods,
};

static PyObject *start_read_shards(PyObject *self, PyObject *args) {
    (void)self;
    pending_t *p = PyObject_New(pending_t, &PendingType);
    if (p == NULL) {
        return NULL;
    }
    memset((char *)p + sizeof(PyObject), 0, sizeof(pending_t) - sizeof(PyObject));
    p->pid = getpid();
    p->state = 2; /* nothing to join or drop until prepared */
    if (prepare_call(args, &p->call, "start_read_shards") < 0) {
        drop_call(&p->call);
        Py_DECREF(p);
        return NULL;
    }
    p->state = 0;
    p->threads = split_jobs(&p->call.base, p->call.n, p->call.threads, p->jobs);
    int inline_from = p->threads;
    for (int t = 0; t < p->threads; t++) {
        p->started[t] = pthread_create(&p->ids[t], NULL, run_job, &p->jobs[t]) == 0;
        if (!p->started[t] && inline_from == p->threads) {
            inline_from = t;
        }
    }
    if (inline_from < p->threads) {
        Py_BEGIN_ALLOW_THREADS
        for (int t = inline_from; t < p->threads; t++) {
            if (!p->started[t]) {
                run_job(&p->jobs[t]);
            }
        }
        Py_END_ALLOW_THREADS
    }
    return (PyObject *)p;
}

/* record_firsts(state, ident, ids, now, seen)
 *
 * claim_first for i in 0..n-1: record now[i] (inode, device, mtime_ns) as shard ids[i]'s
 * first file unless one is recorded; seen[i] = the identity recorded (now[i] when this call
 * recorded it). The records the read loop makes, made from Python (the same protocol, so
 * the two never both record a shard). ids: int64; now, seen: uint64 rows of 3. */
static PyObject *record_firsts(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *objs[5];
    if (!PyArg_ParseTuple(args, "OOOOO", &objs[0], &objs[1], &objs[2], &objs[3], &objs[4])) {
        return NULL;
    }
    static const char *what[5] = {"state", "ident", "ids", "now", "seen"};
    static const int writable[5] = {1, 1, 0, 0, 1};
    static const int type[5] = {UINT8, UINT64, INT64, UINT64, UINT64};
    held_buffer b[5];
    memset(b, 0, sizeof(b));
    PyObject *result = NULL;
    for (int i = 0; i < 5; i++) {
        if (take(objs[i], &b[i], writable[i], type[i], "record_firsts", what[i]) < 0) {
            goto done;
        }
    }
    Py_ssize_t count = b[0].view.len, n = b[2].view.len / 8;
    if (b[1].view.len / 24 != count || b[3].view.len / 24 != n || b[4].view.len / 24 != n) {
        PyErr_SetString(PyExc_ValueError, "record_firsts: arrays of mismatched lengths");
        goto done;
    }
    const int64_t *ids = b[2].view.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= count) {
            PyErr_SetString(PyExc_ValueError, "record_firsts: shard index out of range");
            goto done;
        }
    }
    firsts_t f = {b[0].view.buf, b[1].view.buf, NULL};
    const uint64_t *now = b[3].view.buf;
    uint64_t *seen = b[4].view.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        claim_first(&f, ids[i], now + 3 * i, seen + 3 * i);
    }
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    for (int i = 0; i < 5; i++) {
        release(&b[i]);
    }
    return result;
}

static PyMethodDef methods[] = {
    {"record_firsts", record_firsts, METH_VARARGS,
     "record_firsts(state, ident, ids, now, seen) -> None (see "
     "detdata.storage.first_opens)"},
    {"read_shards", read_shards, METH_VARARGS,
     "read_shards(prefix, names, shards, file_at, wants, out, iov_off, iov_len, iov_count, "
     "stats, threads=1, state=None, ident=None, sizes=None) -> shards fully read (see "
     "detdata.storage.fileread)"},
    {"start_read_shards", start_read_shards, METH_VARARGS,
     "start_read_shards(...the arguments of read_shards...) -> NativeRead (see "
     "detdata.storage.fileread)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "detdata.storage._fileread", NULL, -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__fileread(void) {
    if (PyType_Ready(&PendingType) < 0) {
        return NULL;
    }
    return PyModule_Create(&module);
}
