/*
 * zmqsync.tensors._streamcopy: copies that write past the caches.
 *
 * The learner writes each version of its model into memory other processes read later
 * (a worker's lent tensors, a shared version buffer). Nothing on the learner reads those
 * bytes again, yet an ordinary copy first reads every destination line into the cache
 * (to own it) and then evicts it: three passes over memory for a copy's two. Streaming
 * (non-temporal) stores write whole lines without reading them. glibc's memcpy streams
 * only copies larger than a threshold it derives from the cache (hundreds of MiB on
 * most machines), and torch copies in pieces far smaller, so neither ever does here.
 *
 * fan_out(sources, sizes, dests, k, threads) copies sizes[i] bytes from sources[i] into
 * dests[i * k + j] for each j < k (all three are buffers of native uint64: addresses
 * and lengths), on `threads` threads (the calling one and threads - 1 started for the
 * call), the GIL released. Each thread takes an equal span of the sources' bytes and
 * copies it in blocks small enough to stay in its core's cache while they are written
 * to every destination: the sources are read from memory once whatever k is.
 *
 * The caller vouches for the addresses (tensors it holds for the call). Off x86-64 the
 * module copies with memcpy and says so (STREAMING is False).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <pthread.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define ZS_STREAMING 1
#else
#define ZS_STREAMING 0
#endif

/* Bytes of a source copied to every destination before the next: a few such blocks
 * (one source, k destinations in flight) stay in a core's L2. */
#define ZS_BLOCK ((size_t)256 * 1024)
/* Spans of different threads start on page boundaries of the sources. */
#define ZS_ALIGN ((size_t)4096)
#define ZS_MAX_THREADS 256

static void stream_copy(char *dst, const char *src, size_t n)
{
#if ZS_STREAMING
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    if (head > n)
        head = n;
    memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    size_t i = 0;
    for (; i + 64 <= n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    memcpy(dst + i, src + i, n - i);
#else
    memcpy(dst, src, n);
#endif
}

typedef struct {
    const uint64_t *sources;
    const uint64_t *sizes;
    const uint64_t *dests;
    size_t count;  /* sources */
    size_t k;      /* destinations per source */
    size_t lo, hi; /* this thread's span of the sources' bytes, end to end */
} span_t;

static void copy_span(const span_t *s)
{
    size_t start = 0; /* where source i starts, end to end */
    for (size_t i = 0; i < s->count && start < s->hi; i++) {
        size_t n = (size_t)s->sizes[i];
        size_t end = start + n;
        if (end > s->lo) {
            size_t from = s->lo > start ? s->lo - start : 0;
            size_t to = s->hi < end ? s->hi - start : n;
            const char *src = (const char *)(uintptr_t)s->sources[i];
            for (size_t at = from; at < to; at += ZS_BLOCK) {
                size_t len = to - at < ZS_BLOCK ? to - at : ZS_BLOCK;
                for (size_t j = 0; j < s->k; j++) {
                    char *dst = (char *)(uintptr_t)s->dests[i * s->k + j];
                    stream_copy(dst + at, src + at, len);
                }
            }
        }
        start = end;
    }
#if ZS_STREAMING
    _mm_sfence(); /* the streamed lines are visible before the thread is joined */
#endif
}

static void *run_span(void *arg)
{
    copy_span((const span_t *)arg);
    return NULL;
}

static void fan_out_spans(span_t *spans, size_t threads)
{
    pthread_t ids[ZS_MAX_THREADS];
    int started[ZS_MAX_THREADS];
    for (size_t t = 1; t < threads; t++)
        started[t] = pthread_create(&ids[t], NULL, run_span, &spans[t]) == 0;
    copy_span(&spans[0]);
    for (size_t t = 1; t < threads; t++) {
        if (started[t])
            pthread_join(ids[t], NULL);
        else
            copy_span(&spans[t]); /* no thread to be had: this one copies it */
    }
}

static int words(Py_buffer *b, const char *what, size_t *count)
{
    if (b->len % (Py_ssize_t)sizeof(uint64_t)) {
        PyErr_Format(PyExc_ValueError, "%s: a buffer of uint64, not %zd bytes", what, b->len);
        return -1;
    }
    *count = (size_t)b->len / sizeof(uint64_t);
    return 0;
}

static PyObject *fan_out(PyObject *self, PyObject *args)
{
    Py_buffer sources, sizes, dests;
    Py_ssize_t k, threads;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*y*nn", &sources, &sizes, &dests, &k, &threads))
        return NULL;
    PyObject *result = NULL;
    size_t count, nsizes, ndests;
    if (words(&sources, "sources", &count) || words(&sizes, "sizes", &nsizes)
        || words(&dests, "dests", &ndests))
        goto done;
    if (k < 1 || threads < 1) {
        PyErr_SetString(PyExc_ValueError, "k and threads must be at least 1");
        goto done;
    }
    if (nsizes != count || ndests / (size_t)k != count || ndests % (size_t)k) {
        PyErr_Format(PyExc_ValueError, "%zu sources, %zu sizes and %zu dests for k=%zd",
                     count, nsizes, ndests, k);
        goto done;
    }
    const uint64_t *size = (const uint64_t *)sizes.buf;
    size_t total = 0;
    for (size_t i = 0; i < count; i++) {
        if (size[i] > SIZE_MAX - total) {
            PyErr_SetString(PyExc_OverflowError, "the sizes add up past the address space");
            goto done;
        }
        total += (size_t)size[i];
    }
    size_t n = (size_t)threads < ZS_MAX_THREADS ? (size_t)threads : ZS_MAX_THREADS;
    size_t share = (total / n + ZS_ALIGN - 1) / ZS_ALIGN * ZS_ALIGN;
    if (share == 0)
        share = ZS_ALIGN;
    span_t spans[ZS_MAX_THREADS];
    size_t used = 0;
    for (size_t lo = 0; lo < total && used < n; used++, lo += share) {
        spans[used] = (span_t){(const uint64_t *)sources.buf, size, (const uint64_t *)dests.buf,
                               count, (size_t)k, lo, lo + share < total ? lo + share : total};
    }
    if (used) {
        spans[used - 1].hi = total;
        Py_BEGIN_ALLOW_THREADS
        fan_out_spans(spans, used);
        Py_END_ALLOW_THREADS
    }
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&sources);
    PyBuffer_Release(&sizes);
    PyBuffer_Release(&dests);
    return result;
}

static PyMethodDef methods[] = {
    {"fan_out", fan_out, METH_VARARGS,
     "fan_out(sources, sizes, dests, k, threads): copy sizes[i] bytes from sources[i] to "
     "dests[i*k+j] for each j < k, with streaming stores, on `threads` threads."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_streamcopy",
    "Copies that write past the caches, fanned out to several destinations.", -1, methods,
};

PyMODINIT_FUNC PyInit__streamcopy(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m && PyModule_AddIntConstant(m, "STREAMING", ZS_STREAMING) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
