/* The radix trees' hot walks in C: the same steps in the same order on the same Python objects (the nodes' slots,
 * the hybrid components' LRU lists threaded through them), without the interpreter's per-node overhead. Each has
 * its Python reference beside it (native=False), and tests/test_hybrid_native.py and tests/test_tree_native.py run
 * both on the same random operations, holding every result and every node equal.
 *
 * The hybrid tree (server/tree/hybrid.py):
 * match(tree, root, key, page_bytes, rules, ctx) -> HybridMatch, or NotImplemented for a key to pack first
 *     key: packed int32 tokens (bytes, or a C-contiguous int32 vector: no copy), its whole pages only.
 *     The walk along whole edges of key (children keyed by their first page); an edge the key ends
 *     inside is split through tree._split; then the deepest node every component accepts as a match end (each
 *     component's rule, in registration order, until none moves it), each component's LRU refresh there, the
 *     tree's clock tick (tree._clock), the access times of the path (a parent just older than its child) and
 *     the tree's query counters. The result: ctx[0](indices, matched, node id, hit tokens, SWA branching, MAMBA
 *     branching, MAMBA source), indices being ctx[6] (nothing matched), the node's own FULL slots (one node) or
 *     the path's, end to end (into ctx[1](matched, ctx[2])). ctx[3]: page tokens; ctx[4]: has SWA; ctx[5]: MAMBA
 *     grid.
 * lock_path(node, delta) -> int
 *     HybridTree.lock's and unlock's FULL walk: every node from node up to (not including) its root takes delta
 *     (1 or -1) on its lock count; returns the tokens of the nodes whose count went 0 -> 1 (or 1 -> 0).
 * swa_acquire(node, window) -> (tokens, boundary), swa_release(node, uuid) -> [nodes]
 *     SwaComponent's window lock walks (components/swa.py): the counting and the slock updates; the component
 *     does the rest (counters, the boundary's mark, leaf updates and drops, in walk order).
 * A rule: ("swa", window, budget, head) or ("mamba", head); head is the front sentinel of the component's Lru
 * (server/tree/components/base.py), a list threaded through the nodes' sprev/snext or mprev/mnext slots.
 * The plain tree (server/tree/tree.py, its Node in node.py):
 * full_match(tree, root, key, page_bytes, ctx) -> MatchResult, or NotImplemented for a key to pack first
 * full_descend(tree, root, key, n, page_bytes) -> (path, tail), key_tokens(key) -> int
 * full_insert(tree, root, key, vals, n, prev, priority, chunked, ns, ctx) -> InsertResult, or NotImplemented
 * full_lock(node, leaves) -> tokens, full_unlock(node) -> (tokens, root or None)
 * full_evict(tree, num_tokens, ctx) -> EvictResult: evict without a host tier
 * lock_handle(tree, node_id) -> receipt, unlock_handle(tree, receipt) -> None
 *     lock and unlock themselves, bound to a native tree (the methods take the rare cases)
 *     RadixTree.match_prefix after its root, insert's descent (the whole insert without a host tier), and the
 *     device lock walks (see each function).
 * bind_insert(tree, default_namespace) -> insert itself, bound likewise to a native tree without a host tier
 *     (full_insert's work for the common call; the method takes the rest); its new leaves are built from a
 *     template learned from the Node class (make_node) where the class allows it (node_template_usable)
 * numpy's array fields, constructor and views are used directly once they have proven themselves (int64_view,
 * np_api).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>
#include <structmember.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

static PyObject *s_counters, *s_clock, *s_tick, *s_leaves, *s_hleaves, *s_heap, *s_hheap, *s_heap_seq, *s_key_of,
    *s_compact, *s_dver, *s_hver, *s_handle, *s_nodes, *s_evictable, *s_ev, *s_stored, *s_page_b, *s_protected,
    *s_receipts, *s_lock, *s_unlock, *s_mctx, *s_prune_root, *s_roots, *s_span, *s_push_raw, *s_ictx;
static PyObject *heappush, *heappop;  /* _heapq's */

/* A tree's own attributes (its counters, containers and contexts) read and written in its instance dict, for a class
 * checked once to define no data descriptor under any of these names (HybridTree's sizes are properties): the generic
 * protocol would look each name up in the type first. Anything else takes the generic path. tattr: a new reference. */
#define TYPE_CACHE 8
static PyObject **tree_names[] = {&s_counters, &s_clock, &s_tick, &s_leaves, &s_hleaves, &s_heap, &s_hheap, &s_heap_seq,
                                  &s_key_of, &s_handle, &s_nodes, &s_evictable, &s_ev, &s_page_b, &s_protected,
                                  &s_receipts, &s_mctx, &s_roots, &s_ictx};
static PyTypeObject *checked_tp[TYPE_CACHE];
static char plain_tp[TYPE_CACHE];

static int plain_type(PyTypeObject *tp) {  /* 1: instance dict access is what the generic protocol would do */
    for (int i = 0; i < TYPE_CACHE && checked_tp[i] != NULL; i++)
        if (checked_tp[i] == tp)
            return plain_tp[i];
    int plain = 1;
    for (size_t k = 0; k < sizeof(tree_names) / sizeof(tree_names[0]) && plain; k++) {
        PyObject *d = _PyType_Lookup(tp, *tree_names[k]);  /* borrowed */
        plain = d == NULL || Py_TYPE(d)->tp_descr_set == NULL;
    }
    for (int i = 0; i < TYPE_CACHE; i++)
        if (checked_tp[i] == NULL) {
            checked_tp[i] = (PyTypeObject *)Py_NewRef((PyObject *)tp);  /* kept: the pointer must not be reused */
            plain_tp[i] = (char)plain;
            break;
        }
    return plain;
}

static PyObject *tree_dict(PyObject *tree) {  /* borrowed; NULL (no error set): use the generic protocol */
    PyObject **dp = plain_type(Py_TYPE(tree)) ? _PyObject_GetDictPtr(tree) : NULL;
    if (dp == NULL || *dp == NULL || !PyDict_CheckExact(*dp)) {
        PyErr_Clear();
        return NULL;
    }
    return *dp;
}

static PyObject *tattr(PyObject *tree, PyObject *name) {
    PyObject *d = tree_dict(tree);
    if (d == NULL)
        return PyObject_GetAttr(tree, name);
    PyObject *v = PyDict_GetItemWithError(d, name);
    Py_XINCREF(v);
    return v != NULL || PyErr_Occurred() ? v : PyObject_GetAttr(tree, name);
}

static int tset(PyObject *tree, PyObject *name, PyObject *v) {
    PyObject *d = tree_dict(tree);
    return d == NULL ? PyObject_SetAttr(tree, name, v) : PyDict_SetItem(d, name, v);
}

/* A type's __slots__, read and written at their offsets (what their member descriptors do, without the attribute
 * lookup), learned from the first instance of it seen; any other object, or a slot left unset, goes through the
 * generic attribute protocol by name. */
#define MAX_FIELDS 16
typedef struct {
    const char *const *cnames;
    int n;
    PyObject *names[MAX_FIELDS];  /* interned at import */
    PyTypeObject *tp;
    Py_ssize_t off[MAX_FIELDS];
} Layout;

static int layout_of(Layout *lay, PyTypeObject *tp) {  /* 1: the offsets are known */
    if (lay->tp == tp)
        return 1;
    if (lay->tp != NULL || !(tp->tp_flags & Py_TPFLAGS_HEAPTYPE) || tp->tp_dict == NULL)
        return 0;
    for (int k = 0; k < lay->n; k++) {
        PyObject *d = PyDict_GetItemWithError(tp->tp_dict, lay->names[k]);
        if (d == NULL || Py_TYPE(d) != &PyMemberDescr_Type ||
            ((PyMemberDescrObject *)d)->d_member->type != T_OBJECT_EX) {
            PyErr_Clear();
            return 0;
        }
        lay->off[k] = ((PyMemberDescrObject *)d)->d_member->offset;
    }
    Py_INCREF(tp);
    lay->tp = tp;
    return 1;
}

static inline PyObject **at(PyObject *obj, Py_ssize_t off) { return (PyObject **)((char *)obj + off); }

static inline PyObject *lget(const Layout *lay, PyObject *obj, int k) {  /* a new reference */
    if (Py_TYPE(obj) == lay->tp) {
        PyObject *v = *at(obj, lay->off[k]);
        if (v != NULL) {
            Py_INCREF(v);
            return v;
        }
    }
    return PyObject_GetAttr(obj, lay->names[k]);
}

static inline int lset(const Layout *lay, PyObject *obj, int k, PyObject *v) {  /* v borrowed */
    if (Py_TYPE(obj) == lay->tp) {
        PyObject **slot = at(obj, lay->off[k]), *old = *slot;
        Py_INCREF(v);
        *slot = v;
        Py_XDECREF(old);
        return 0;
    }
    return PyObject_SetAttr(obj, lay->names[k], v);
}

static int ladd(const Layout *lay, PyObject *obj, int k, Py_ssize_t delta, Py_ssize_t *now) {  /* obj.<k> += delta */
    PyObject *v = lget(lay, obj, k);
    if (v == NULL)
        return -1;
    Py_ssize_t was = PyLong_AsSsize_t(v);
    Py_DECREF(v);
    if (was == -1 && PyErr_Occurred())
        return -1;
    *now = was + delta;
    PyObject *w = PyLong_FromSsize_t(*now);
    int r = w == NULL ? -1 : lset(lay, obj, k, w);
    Py_XDECREF(w);
    return r;
}

/* HNode (server/tree/hybrid.py) */
enum { K_CHILDREN, K_KEY, K_PARENT, K_ATIME, K_SWA, K_N, K_MAMBA, K_FULL, K_LOCK, K_SLOCK, K_SUUID, K_ID, K_SPREV,
       K_SNEXT, K_MPREV, K_MNEXT, K_SLOTS };
static const char *const node_names[K_SLOTS] = {"children", "key", "parent", "atime", "swa", "n", "mamba", "full",
                                                "lock", "slock", "suuid", "id", "sprev", "snext", "mprev", "mnext"};
static Layout node_layout = {node_names, K_SLOTS};
#define nget(obj, k) lget(&node_layout, (obj), (k))
#define nset(obj, k, v) lset(&node_layout, (obj), (k), (v))
#define learn_slots(tp) layout_of(&node_layout, (tp))

/* numpy's array struct (PyArrayObject_fields, the same in numpy 1.x and 2.x) up to its flags; read directly once the
 * first ndarray seen has shown the same data, length and item kind through the buffer protocol. */
typedef struct {
    PyObject_HEAD
    char *data;
    int nd;
    Py_ssize_t *dimensions, *strides;
    PyObject *base;
    struct { PyObject_HEAD PyTypeObject *typeobj; char kind, type, byteorder; } *descr;
    int flags;
} NpArray;
static PyTypeObject *np_type;
static int np_tried;
#define I64(d) ((d)->kind == 'i' && ((d)->type == 'l' || (d)->type == 'q'))  /* int64 on LP64 */

/* Learn numpy's array type from an ndarray whose fields agree with what the buffer protocol says of it. */
static void np_learn(PyObject *arr, const Py_buffer *view) {
    if (np_tried || strcmp(Py_TYPE(arr)->tp_name, "numpy.ndarray") != 0)
        return;
    np_tried = 1;
    NpArray *a = (NpArray *)arr;
    const char *f = view->format ? view->format : "B";
    f += (*f == '<' || *f == '=' || *f == '@');
    if (a->nd == 1 && a->data == view->buf && a->dimensions[0] * view->itemsize == view->len &&
        a->strides[0] == view->itemsize && a->descr->type == *f && !f[1]) {
        Py_INCREF(Py_TYPE(arr));
        np_type = Py_TYPE(arr);
    }
}

/* An int64 vector's memory: numpy's own fields where they were proven, else the buffer protocol (view->obj set:
 * release it). */
static int int64_view(PyObject *arr, Py_buffer *view, int flags) {
    view->obj = NULL;
    if (Py_TYPE(arr) == np_type) {
        NpArray *a = (NpArray *)arr;
        if (a->nd == 1 && a->strides[0] == 8 && I64(a->descr) && (a->flags & 0x1) &&
            (!(flags & PyBUF_WRITABLE) || (a->flags & 0x400))) {  /* C-contiguous; writeable */
            view->buf = a->data;
            view->len = a->dimensions[0] * 8;
            return 0;
        }
    }
    if (PyObject_GetBuffer(arr, view, flags | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    const char *f = view->format ? view->format : "B";
    f += (*f == '<' || *f == '=' || *f == '@');
    if (view->itemsize != 8 || (*f != 'q' && *f != 'l') || f[1]) {
        PyBuffer_Release(view);
        view->obj = NULL;
        PyErr_SetString(PyExc_TypeError, "a node's FULL slots are int64");
        return -1;
    }
    np_learn(arr, view);
    return 0;
}

/* numpy's PyArray_New (entry 93 of its C API table; PyArray_Type is entry 2: fixed since numpy 1.0), found through
 * the capsule numpy exports, used once one-element int64 and int32 vectors made with it read back right; until
 * then, and without it, ctx's np.empty. */
typedef PyObject *(*np_new_fn)(PyTypeObject *, int, const Py_ssize_t *, int, const Py_ssize_t *, void *, int, int,
                               PyObject *);
static np_new_fn np_new;
typedef int (*np_setbase_fn)(PyObject *, PyObject *);  /* PyArray_SetBaseObject: entry 282, steals the base */
static np_setbase_fn np_setbase;

static void np_api(void) {
    static int tried;
    if (tried || np_type == NULL)
        return;
    tried = 1;
    PyObject *mod = PyImport_ImportModule("numpy._core._multiarray_umath");  /* numpy 2; numpy 1: numpy.core */
    if (mod == NULL) {
        PyErr_Clear();
        mod = PyImport_ImportModule("numpy.core._multiarray_umath");
    }
    PyObject *cap = mod ? PyObject_GetAttrString(mod, "_ARRAY_API") : NULL;
    Py_XDECREF(mod);
    void **api = cap && PyCapsule_CheckExact(cap) ? PyCapsule_GetPointer(cap, NULL) : NULL;
    Py_XDECREF(cap);  /* the table lives as long as numpy's module */
    if (api == NULL || (PyTypeObject *)api[2] != np_type || sizeof(long) != 8) {
        PyErr_Clear();
        return;
    }
    np_new_fn f = (np_new_fn)api[93];
    const int typenums[2] = {7 /* NPY_LONG: int64 on LP64 */, 5 /* NPY_INT: int32 */};
    const char types[2] = {'l', 'i'};
    for (int i = 0; i < 2; i++) {
        Py_ssize_t one = 1;
        PyObject *probe = f(np_type, 1, &one, typenums[i], NULL, NULL, 0, 0, NULL);
        if (probe == NULL) {
            PyErr_Clear();
            return;
        }
        NpArray *a = (NpArray *)probe;
        int ok = Py_TYPE(probe) == np_type && a->nd == 1 && a->dimensions[0] == 1 && a->strides[0] == 8 - 4 * i &&
                 a->descr->kind == 'i' && a->descr->type == types[i] && (a->flags & 0x401) == 0x401;
        Py_DECREF(probe);
        if (!ok)
            return;
    }
    np_new = f;
    /* a view made with it over a vector's data, its base set: proven by the view reading the vector's own item */
    np_setbase_fn setbase = (np_setbase_fn)api[282];
    Py_ssize_t two = 2, one = 1;
    PyObject *owner = f(np_type, 1, &two, 5, NULL, NULL, 0, 0, NULL), *view = NULL;
    if (owner != NULL) {
        ((int *)((NpArray *)owner)->data)[1] = 0x5eed;
        view = f(np_type, 1, &one, 5, NULL, ((NpArray *)owner)->data + 4, 0, 0x1 | 0x100, NULL);
    }
    if (view != NULL && setbase(view, Py_NewRef(owner)) == 0 && ((NpArray *)view)->base == owner &&
        Py_REFCNT(owner) == 2 && ((int *)((NpArray *)view)->data)[0] == 0x5eed && !(((NpArray *)view)->flags & 0x4))
        np_setbase = setbase;
    Py_XDECREF(view);
    Py_XDECREF(owner);
    PyErr_Clear();
}

/* arr[start:] of a C-contiguous int32 vector arr, as numpy slices it (a view, writeable as arr is). */
static PyObject *tail_of(PyObject *arr, Py_ssize_t start) {
    np_api();
    NpArray *a = (NpArray *)arr;
    if (np_setbase == NULL || Py_TYPE(arr) != np_type || a->nd != 1 || a->strides[0] != 4 || a->descr->type != 'i' ||
        !(a->flags & 0x1) || start < 0 || start > a->dimensions[0])
        return PySequence_GetSlice(arr, start, PY_SSIZE_T_MAX);
    Py_ssize_t n = a->dimensions[0] - start;
    PyObject *view = np_new(np_type, 1, &n, 5, NULL, a->data + 4 * start, 0, 0x1 | 0x100 | (a->flags & 0x400), NULL);
    if (view != NULL && np_setbase(view, Py_NewRef(arr)) < 0)
        Py_CLEAR(view);
    return view;
}

/* A new int64 (wide) or int32 vector of n items: numpy's own constructor where proven, else empty(n, dtype). */
static PyObject *new_vector(Py_ssize_t n, int wide, PyObject *empty, PyObject *dtype) {
    np_api();
    if (np_new != NULL)
        return np_new(np_type, 1, &n, wide ? 7 : 5, NULL, NULL, 0, 0, NULL);
    PyObject *size = PyLong_FromSsize_t(n);
    if (size == NULL)
        return NULL;
    PyObject *args[2] = {size, dtype};
    PyObject *out = PyObject_Vectorcall(empty, args, 2, NULL);
    Py_DECREF(size);
    return out;
}

static void int64_release(Py_buffer *view) {
    if (view->obj != NULL)
        PyBuffer_Release(view);
}

/* The nodes of a match's path (new references) and the tokens on each edge: a C array, no list. */
typedef struct {
    PyObject **node;
    Py_ssize_t *ntok;
    Py_ssize_t len, cap;
    PyObject *node0[32];
    Py_ssize_t ntok0[32];
} Path;

static void path_init(Path *p) {
    p->node = p->node0;
    p->ntok = p->ntok0;
    p->len = 0;
    p->cap = 32;
}

static void path_free(Path *p) {
    for (Py_ssize_t i = 0; i < p->len; i++)
        Py_DECREF(p->node[i]);
    if (p->node != p->node0) {
        PyMem_Free(p->node);
        PyMem_Free(p->ntok);
    }
}

static int path_push(Path *p, PyObject *node, Py_ssize_t ntok) {  /* steals node */
    if (p->len == p->cap) {
        Py_ssize_t cap = p->cap * 2;
        PyObject **nodes = PyMem_Malloc(sizeof(PyObject *) * (size_t)cap);
        Py_ssize_t *ntoks = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)cap);
        if (nodes == NULL || ntoks == NULL) {
            PyMem_Free(nodes);
            PyMem_Free(ntoks);
            Py_DECREF(node);
            PyErr_NoMemory();
            return -1;
        }
        memcpy(nodes, p->node, sizeof(PyObject *) * (size_t)p->len);
        memcpy(ntoks, p->ntok, sizeof(Py_ssize_t) * (size_t)p->len);
        if (p->node != p->node0) {
            PyMem_Free(p->node);
            PyMem_Free(p->ntok);
        }
        p->node = nodes;
        p->ntok = ntoks;
        p->cap = cap;
    }
    p->node[p->len] = node;
    p->ntok[p->len++] = ntok;
    return 0;
}

static PyObject *probe;  /* a bytes object only find_child ever sees: rewritten in place for each dict lookup */

/* A bytes key holding page, for a lookup only (a new reference): the probe when no one else holds it, so a walk
 * allocates no key per level. */
static PyObject *probe_key(const char *page, Py_ssize_t pb) {
#if PY_VERSION_HEX >= 0x030F0000  /* bytes' cached hash is deprecated since 3.11: past 3.14, no probe */
    return PyBytes_FromStringAndSize(page, pb);
#else
    if (probe == NULL || Py_REFCNT(probe) != 1 || PyBytes_GET_SIZE(probe) != pb) {
        PyObject *fresh = PyBytes_FromStringAndSize(page, pb);
        if (fresh != NULL && (probe == NULL || Py_REFCNT(probe) == 1))
            Py_XSETREF(probe, Py_NewRef(fresh));
        return fresh;
    }
    memcpy(PyBytes_AS_STRING(probe), page, (size_t)pb);
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
    ((PyBytesObject *)probe)->ob_shash = -1;  /* its cached hash was of the last page */
#pragma GCC diagnostic pop
    return Py_NewRef(probe);
#endif
}

/* children[page] (a new reference), or NULL (with an error set, or none: no such child). A few children: their pages
 * are compared, no hash of ours to compute. */
static PyObject *find_child(PyObject *children, const char *page, Py_ssize_t pb) {
    PyObject *child = NULL;
    int scanned = PyDict_GET_SIZE(children) <= 4;
    if (scanned) {
        Py_ssize_t pos = 0;
        PyObject *k, *v;
        while (PyDict_Next(children, &pos, &k, &v)) {
            if (!PyBytes_CheckExact(k)) {
                scanned = 0;
                break;
            }
            if (PyBytes_GET_SIZE(k) == pb && memcmp(PyBytes_AS_STRING(k), page, pb) == 0) {
                child = v;
                break;
            }
        }
    }
    if (!scanned) {
        PyObject *key = probe_key(page, pb);
        if (key == NULL)
            return NULL;
        child = PyDict_GetItemWithError(children, key);
        Py_DECREF(key);
    }
    Py_XINCREF(child);
    return child;
}

/* A key's packed little-endian int32 tokens, read in place: bytes, or a C-contiguous int32 vector. 1: read
 * (release with int64_release), 0: something else (the caller packs it), -1: an error. */
static int read_key(PyObject *obj, Py_buffer *key) {
    NpArray *ka = (NpArray *)obj;
    if (Py_TYPE(ka) == np_type && ka->nd == 1 && ka->strides[0] == 4 && ka->descr->kind == 'i' &&
        ka->descr->type == 'i' && ka->descr->byteorder != '>' && (ka->flags & 0x1)) {  /* as proven by np_learn */
        key->obj = NULL;
        key->buf = ka->data;
        key->len = ka->dimensions[0] * 4;
        return 1;
    }
    if (!PyObject_CheckBuffer(obj))
        return 0;
    if (PyObject_GetBuffer(obj, key, PyBUF_RECORDS_RO) < 0)
        return -1;
    const char *f = key->format ? key->format : "B";
    f += (*f == '<' || *f == '=' || *f == '@');
    if (!((key->itemsize == 1 && (*f == 'B' || *f == 'b' || *f == 'c')) || (key->itemsize == 4 && *f == 'i')) ||
        f[1] || key->ndim > 1 || key->len % 4 || !PyBuffer_IsContiguous(key, 'C')) {
        PyBuffer_Release(key);
        return 0;
    }
    if (key->itemsize == 4)
        np_learn(obj, key);
    return 1;
}

/* The walk of match() over the whole pages of kb[:len]: whole edges onto path; an edge the key ends inside is split
 * through tree._split and its upper part ends the path. *hit: every matched token. */
static int walk(PyObject *tree, PyObject *root, const char *kb, Py_ssize_t len, Py_ssize_t pb, Path *path,
                Py_ssize_t *hit) {
    len -= len % pb;
    PyObject *node = root;  /* borrowed: root, then the path's last node */
    Py_ssize_t off = 0;
    *hit = 0;
    while (off + pb <= len) {
        PyObject *children = nget(node, K_CHILDREN);
        if (children == NULL)
            return -1;
        if (!PyDict_Check(children)) {
            Py_DECREF(children);
            PyErr_SetString(PyExc_TypeError, "walk: children must be a dict");
            return -1;
        }
        PyObject *child = find_child(children, kb + off, pb);
        Py_DECREF(children);
        if (child == NULL)
            return PyErr_Occurred() ? -1 : 0;
        PyObject *ck = nget(child, K_KEY);
        if (ck == NULL || !PyBytes_Check(ck)) {
            Py_XDECREF(ck);
            Py_DECREF(child);
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_TypeError, "walk: a node's key must be bytes");
            return -1;
        }
        Py_ssize_t cl = PyBytes_GET_SIZE(ck);
        const char *a = PyBytes_AS_STRING(ck), *b = kb + off;
        /* the first page is equal already (the dict's key) */
        if (cl <= len - off && cl >= pb && memcmp(a + pb, b + pb, (size_t)(cl - pb)) == 0) {
            Py_DECREF(ck);
            if (path_push(path, child, cl / 4) < 0)
                return -1;
            off += cl;
            *hit += cl / 4;
            node = child;
            continue;
        }
        Py_ssize_t ntok = (cl < len - off ? cl : len - off) / 4, i = 0;
        while (i < ntok && memcmp(a + 4 * i, b + 4 * i, 4) == 0)
            i++;
        Py_DECREF(ck);
        Py_ssize_t common = i - i % (pb / 4);
        *hit += common;
        PyObject *end = child;
        if (common * 4 < cl) {
            end = PyObject_CallMethod(tree, "_split", "On", child, common);
            Py_DECREF(child);
            if (end == NULL)
                return -1;
        }
        return path_push(path, end, common);
    }
    return 0;
}

static int attr_ssize(PyObject *obj, int k, Py_ssize_t *out) {
    PyObject *v = nget(obj, k);
    if (v == NULL)
        return -1;
    *out = PyLong_AsSsize_t(v);
    Py_DECREF(v);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

static int attr_true(PyObject *obj, int k) {
    PyObject *v = nget(obj, k);
    if (v == NULL)
        return -1;
    int r = PyObject_IsTrue(v);
    Py_DECREF(v);
    return r;
}

static Py_ssize_t swa_deepest_impl(const Path *path, Py_ssize_t limit, Py_ssize_t window) {
    int unbounded = 1;  /* no gap since the root: any node may end a match */
    Py_ssize_t covered = 0, best = 0;
    for (Py_ssize_t i = 0; i < limit; i++) {
        int has = attr_true(path->node[i], K_SWA);
        if (has < 0)
            return -1;
        if (!has) {
            unbounded = 0;
            covered = 0;
            continue;
        }
        covered += path->ntok[i];
        if (unbounded || covered >= window)
            best = i + 1;
    }
    return best;
}

static Py_ssize_t mamba_deepest_impl(const Path *path, Py_ssize_t limit) {
    for (Py_ssize_t i = limit - 1; i >= 0; i--) {
        Py_ssize_t slot;
        if (attr_ssize(path->node[i], K_MAMBA, &slot) < 0)
            return -1;
        if (slot >= 0)
            return i + 1;
    }
    return 0;
}

static int touch_impl(PyObject *node, double t, double step) {
    Py_INCREF(node);
    while (node != Py_None) {
        PyObject *v = PyFloat_FromDouble(t);
        if (v == NULL || nset(node, K_ATIME, v) < 0) {
            Py_XDECREF(v);
            Py_DECREF(node);
            return -1;
        }
        Py_DECREF(v);
        t -= step;
        PyObject *parent = nget(node, K_PARENT);
        Py_DECREF(node);
        if (parent == NULL)
            return -1;
        node = parent;
    }
    Py_DECREF(node);
    return 0;
}

/* Lru.reset_path's move (components/base.py): unlink node, then link it right after `after`; kp/kn are the slots
 * that thread the list (a node outside it has None there: KeyError). */
static int move_after(PyObject *after, PyObject *node, int kp, int kn) {
    PyObject *p = nget(node, kp), *n = nget(node, kn), *m = NULL;
    int r = -1;
    if (p == NULL || n == NULL)
        goto done;
    if (p == Py_None || n == Py_None) {
        PyErr_SetObject(PyExc_KeyError, node);
        goto done;
    }
    if (nset(p, kn, n) < 0 || nset(n, kp, p) < 0 || (m = nget(after, kn)) == NULL)
        goto done;
    r = (nset(node, kp, after) < 0 || nset(node, kn, m) < 0 || nset(after, kn, node) < 0 || nset(m, kp, node) < 0)
            ? -1 : 0;
done:
    Py_XDECREF(p);
    Py_XDECREF(n);
    Py_XDECREF(m);
    return r;
}

/* Lru.reset_path_mru: node and its ancestors within budget tokens to the front, node first. */
static int lru_path_impl(PyObject *head, PyObject *node, double budget, int attr, int kp, int kn) {
    PyObject *after = head;  /* borrowed: head, or a node of node's path (the tree holds both) */
    Py_INCREF(node);
    double used = 0;
    for (;;) {
        PyObject *parent = nget(node, K_PARENT);
        if (parent == NULL)
            goto fail;
        if (parent == Py_None || used >= budget) {
            Py_DECREF(parent);
            break;
        }
        int has = attr_true(node, attr);
        Py_ssize_t n;
        PyObject *p = has > 0 ? nget(node, kp) : NULL;
        if (has < 0 || (has && p == NULL) || (has && p != after && move_after(after, node, kp, kn) < 0) ||
            attr_ssize(node, K_N, &n) < 0) {
            Py_XDECREF(p);
            Py_DECREF(parent);
            goto fail;
        }
        Py_XDECREF(p);
        if (has)
            after = node;
        used += (double)n;
        Py_DECREF(node);
        node = parent;
    }
    Py_DECREF(node);
    return 0;
fail:
    Py_DECREF(node);
    return -1;
}

/* The path's FULL slots (int64 arrays) end to end, into out (total bytes). */
static int concat_impl(const Path *path, Py_ssize_t limit, char *out, Py_ssize_t total) {
    char *dst = out, *end = out + total;
    for (Py_ssize_t i = 0; i < limit; i++) {
        PyObject *full = nget(path->node[i], K_FULL);
        Py_buffer v;
        if (full == NULL || int64_view(full, &v, PyBUF_SIMPLE) < 0) {
            Py_XDECREF(full);
            return -1;
        }
        Py_DECREF(full);
        int fits = v.len <= end - dst;
        if (fits)
            memcpy(dst, v.buf, (size_t)v.len);
        dst += v.len;
        int64_release(&v);
        if (!fits)
            break;
    }
    if (dst != end) {
        PyErr_SetString(PyExc_ValueError, "concat: a node's FULL slots are one per token");
        return -1;
    }
    return 0;
}

static const char *const counter_names[] = {"queried_tokens", "hit_tokens", "host_hit_tokens"};
static Layout counters_layout = {counter_names, 3};
static const char *const result_names[] = {"indices", "matched_len", "node_id", "full_hit_len", "swa_branching_seqlen",
                                           "mamba_branching_seqlen", "mamba_src"};
static Layout result_layout = {result_names, 7};

/* counters.<k-th of counter_names> += delta */
static int counter_add(PyObject *counters, int k, Py_ssize_t delta) {
    Py_ssize_t now;
    layout_of(&counters_layout, Py_TYPE(counters));
    return ladd(&counters_layout, counters, k, delta, &now);
}

/* cls(*res) (res: n new references, all stolen); a slots class with these field names is filled in place. */
static PyObject *make_result(Layout *lay, PyObject *cls, PyObject **res, int n) {
    PyObject *out = NULL;
    int ok = 1;
    for (int i = 0; i < n; i++)
        ok &= res[i] != NULL;
    if (ok && PyType_Check(cls) && lay->n == n && layout_of(lay, (PyTypeObject *)cls)) {
        PyTypeObject *tp = (PyTypeObject *)cls;
        if ((out = tp->tp_alloc(tp, 0)) != NULL) {
            for (int i = 0; i < n; i++) {
                *at(out, lay->off[i]) = res[i];
                res[i] = NULL;
            }
        }
    } else if (ok) {
        out = PyObject_Vectorcall(cls, res, (size_t)n, NULL);
    }
    for (int i = 0; i < n; i++)
        Py_XDECREF(res[i]);
    return out;
}

/* tokens - tokens % grid when it lies beyond matched, else None (where the next checkpoint goes) */
static PyObject *branching(Py_ssize_t tokens, Py_ssize_t grid, Py_ssize_t matched) {
    Py_ssize_t aligned = tokens - tokens % grid;
    if (aligned > matched)
        return PyLong_FromSsize_t(aligned);
    Py_RETURN_NONE;
}

static const char match_sig[] =
    "match(tree, root, key, page_bytes, rules: tuple, ctx: (result_type, empty, int64, page, swa: bool, "
    "mamba_grid, no_slots))";

/* One rule per auxiliary component, in registration order: ("swa", window, budget, head) or ("mamba", head) (the
 * component's match end, then its LRU refresh at the match end; head: its LRU list's front sentinel). */
static PyObject *match(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6 || !PyTuple_Check(args[4]) || !PyTuple_Check(args[5]) || PyTuple_GET_SIZE(args[5]) != 7) {
        PyErr_SetString(PyExc_TypeError, match_sig);
        return NULL;
    }
    PyObject *tree = args[0], *root = args[1], *rules = args[4], *ctx = args[5];
    learn_slots(Py_TYPE(root));
    Py_ssize_t nrules = PyTuple_GET_SIZE(rules);
    for (Py_ssize_t r = 0; r < nrules; r++) {
        PyObject *rule = PyTuple_GET_ITEM(rules, r);
        Py_ssize_t size = PyTuple_Check(rule) ? PyTuple_GET_SIZE(rule) : 0;  /* 4: SWA, 2: MAMBA */
        PyObject *kind = size ? PyTuple_GET_ITEM(rule, 0) : NULL;
        if ((size != 4 && size != 2) || !PyUnicode_Check(kind) ||
            PyUnicode_CompareWithASCIIString(kind, size == 4 ? "swa" : "mamba") != 0) {
            PyErr_SetString(PyExc_TypeError, "match: a rule is ('swa', window, budget, head) or ('mamba', head)");
            return NULL;
        }
    }
    Py_ssize_t pb = PyLong_AsSsize_t(args[3]), page = PyLong_AsSsize_t(PyTuple_GET_ITEM(ctx, 3)),
               grid = PyLong_AsSsize_t(PyTuple_GET_ITEM(ctx, 5));
    int swa_on = PyObject_IsTrue(PyTuple_GET_ITEM(ctx, 4));
    if (PyErr_Occurred())
        return NULL;
    if (pb <= 0 || pb % 4 || page <= 0 || grid < 0 || swa_on < 0) {
        PyErr_Format(PyExc_ValueError, "match: page of %zd bytes, %zd tokens, MAMBA grid %zd", pb, page, grid);
        return NULL;
    }
    Py_buffer key;
    int got = read_key(args[2], &key);
    if (got <= 0)
        return got < 0 ? NULL : Py_NewRef(Py_NotImplemented);  /* the caller packs it */
    Path path;
    path_init(&path);
    Py_ssize_t hit, queried = (key.len - key.len % pb) / 4;
    /* the caller holds the key; a split runs no code that could resize it */
    int walked = walk(tree, root, key.buf, key.len, pb, &path, &hit);
    int64_release(&key);
    PyObject *out = NULL, *indices = NULL, *counters = NULL, *clock = NULL;
    if (walked < 0)
        goto done;
    Py_ssize_t best_n = path.len;
    int settled = 0;
    while (!settled && best_n) {  /* the deepest node every component accepts as a match end */
        settled = 1;
        for (Py_ssize_t r = 0; r < nrules; r++) {
            PyObject *rule = PyTuple_GET_ITEM(rules, r);
            Py_ssize_t n;
            if (PyTuple_GET_SIZE(rule) == 4) {
                Py_ssize_t window = PyLong_AsSsize_t(PyTuple_GET_ITEM(rule, 1));
                if (window == -1 && PyErr_Occurred())
                    goto done;
                n = swa_deepest_impl(&path, best_n, window);
            } else {
                n = mamba_deepest_impl(&path, best_n);
            }
            if (n < 0)
                goto done;
            if (n != best_n) {
                best_n = n;
                settled = 0;
            }
        }
    }
    PyObject *best = best_n ? path.node[best_n - 1] : root;
    for (Py_ssize_t r = 0; r < nrules; r++) {
        PyObject *rule = PyTuple_GET_ITEM(rules, r);
        if (PyTuple_GET_SIZE(rule) == 4) {
            double budget = PyFloat_AsDouble(PyTuple_GET_ITEM(rule, 2));
            if ((budget == -1.0 && PyErr_Occurred()) ||
                lru_path_impl(PyTuple_GET_ITEM(rule, 3), best, budget, K_SWA, K_SPREV, K_SNEXT) < 0)
                goto done;
        } else {
            Py_ssize_t slot;
            if (attr_ssize(best, K_MAMBA, &slot) < 0 ||
                (slot >= 0 && move_after(PyTuple_GET_ITEM(rule, 1), best, K_MPREV, K_MNEXT) < 0))
                goto done;
        }
    }
    clock = tattr(tree, s_clock);  /* the tree's _clock_tick() */
    if (clock == NULL)
        goto done;
    double t = PyFloat_AsDouble(clock);
    Py_CLEAR(clock);
    if ((t == -1.0 && PyErr_Occurred()) || (clock = PyFloat_FromDouble(t + 1.0)) == NULL ||
        tset(tree, s_clock, clock) < 0 || touch_impl(best, t, 1e-5) < 0)
        goto done;
    Py_ssize_t matched = 0;
    for (Py_ssize_t i = 0; i < best_n; i++)
        matched += path.ntok[i];
    if (best_n == 0) {
        indices = PyTuple_GET_ITEM(ctx, 6);
        Py_INCREF(indices);
    } else if (best_n == 1) {
        indices = nget(best, K_FULL);
    } else {  /* a new int64 vector, filled in place */
        indices = new_vector(matched, 1, PyTuple_GET_ITEM(ctx, 1), PyTuple_GET_ITEM(ctx, 2));
        Py_buffer v;
        if (indices == NULL || int64_view(indices, &v, PyBUF_WRITABLE) < 0)
            goto done;
        int r = v.len == matched * 8 ? concat_impl(&path, best_n, v.buf, v.len) : -1;
        if (r < 0 && !PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "match: the result array has the wrong size");
        int64_release(&v);
        if (r < 0)
            goto done;
    }
    if (indices == NULL || (counters = tattr(tree, s_counters)) == NULL ||
        counter_add(counters, 0, queried) < 0 || counter_add(counters, 1, matched) < 0)
        goto done;
    PyObject *res[7] = {indices, PyLong_FromSsize_t(matched), nget(best, K_ID), PyLong_FromSsize_t(hit), NULL,
                        NULL, NULL};
    if (swa_on) {
        res[4] = branching(hit, page, matched);
    } else {
        res[4] = Py_None;
        Py_INCREF(Py_None);
    }
    if (grid) {
        res[5] = branching(hit, grid, matched);
        res[6] = nget(best, K_MAMBA);
    } else {
        res[5] = Py_None;
        Py_INCREF(Py_None);
        res[6] = PyLong_FromLong(-1);
    }
    indices = NULL;  /* res[0] */
    out = make_result(&result_layout, PyTuple_GET_ITEM(ctx, 0), res, 7);
done:
    Py_XDECREF(indices);
    Py_XDECREF(counters);
    Py_XDECREF(clock);
    path_free(&path);
    return out;
}

static int add_to(PyObject *node, int k, Py_ssize_t delta, Py_ssize_t *was) {  /* *was: the value before */
    Py_ssize_t now;
    int r = ladd(&node_layout, node, k, delta, &now);
    *was = now - delta;
    return r;
}

/* 1 and a new reference to node's parent, 0 at a root (no parent), -1 on error. */
static int parent_of(PyObject *node, PyObject **parent) {
    *parent = nget(node, K_PARENT);
    if (*parent == NULL)
        return -1;
    if (*parent == Py_None) {
        Py_DECREF(*parent);
        return 0;
    }
    return 1;
}

/* (node, int) arguments; learns HNode's slots from the node's type. */
static int node_and_int(PyObject *const *args, Py_ssize_t nargs, const char *sig, Py_ssize_t *value) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, sig);
        return -1;
    }
    *value = PyLong_AsSsize_t(args[1]);
    if (*value == -1 && PyErr_Occurred())
        return -1;
    learn_slots(Py_TYPE(args[0]));
    return 0;
}

static PyObject *lock_path(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t delta;
    if (node_and_int(args, nargs, "lock_path(node, delta)", &delta) < 0)
        return NULL;
    if (delta != 1 && delta != -1) {
        PyErr_SetString(PyExc_ValueError, "lock_path: delta is 1 or -1");
        return NULL;
    }
    Py_ssize_t changed = 0;
    PyObject *node = args[0];
    Py_INCREF(node);
    PyObject *parent;
    int up;
    while ((up = parent_of(node, &parent)) > 0) {
        Py_ssize_t lock, n;
        if (attr_ssize(node, K_N, &n) < 0 || add_to(node, K_LOCK, delta, &lock) < 0) {
            Py_DECREF(parent);
            goto fail;
        }
        if (lock == (delta > 0 ? 0 : 1))
            changed += n;
        Py_DECREF(node);
        node = parent;
    }
    if (up < 0)
        goto fail;
    Py_DECREF(node);
    return PyLong_FromSsize_t(changed);
fail:
    Py_DECREF(node);
    return NULL;
}

static PyObject *swa_acquire(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t window;
    if (node_and_int(args, nargs, "swa_acquire(node, window)", &window) < 0)
        return NULL;
    Py_ssize_t covered = 0, moved = 0;
    PyObject *node = args[0], *boundary = Py_None;
    Py_INCREF(node);
    Py_INCREF(boundary);
    PyObject *parent;
    int up = 0;
    while (covered < window && (up = parent_of(node, &parent)) > 0) {
        Py_ssize_t slock, n;
        int has = attr_true(node, K_SWA);
        if (has < 0 || attr_ssize(node, K_N, &n) < 0 || add_to(node, K_SLOCK, 1, &slock) < 0) {
            Py_DECREF(parent);
            goto fail;
        }
        if (slock == 0 && has)
            moved += n;
        covered += n;
        if (covered >= window) {
            Py_DECREF(boundary);
            boundary = node;
            Py_INCREF(boundary);
        }
        Py_DECREF(node);
        node = parent;
    }
    if (up < 0)
        goto fail;
    Py_DECREF(node);
    return Py_BuildValue("(nN)", moved, boundary);
fail:
    Py_DECREF(node);
    Py_DECREF(boundary);
    return NULL;
}

static PyObject *swa_release(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t uuid;
    if (node_and_int(args, nargs, "swa_release(node, uuid)", &uuid) < 0)
        return NULL;
    PyObject *zeroed = PyList_New(0), *node = args[0];
    if (zeroed == NULL)
        return NULL;
    Py_INCREF(node);
    PyObject *parent;
    int up;
    while ((up = parent_of(node, &parent)) > 0) {
        Py_ssize_t slock, mark;
        if (attr_ssize(node, K_SLOCK, &slock) < 0 || attr_ssize(node, K_SUUID, &mark) < 0) {
            Py_DECREF(parent);
            goto fail;
        }
        if (slock <= 0) {
            PyObject *id = PyObject_GetAttrString(node, "id");
            PyErr_Format(PyExc_AssertionError, "SWA release below zero on node %R", id ? id : Py_None);
            Py_XDECREF(id);
            Py_DECREF(parent);
            goto fail;
        }
        if (add_to(node, K_SLOCK, -1, &slock) < 0 || (slock == 1 && PyList_Append(zeroed, node) < 0)) {
            Py_DECREF(parent);
            goto fail;
        }
        Py_DECREF(node);
        node = parent;
        if (uuid && mark == uuid)
            break;
    }
    if (up < 0)
        goto fail;
    Py_DECREF(node);
    return zeroed;
fail:
    Py_DECREF(node);
    Py_DECREF(zeroed);
    return NULL;
}

/* ---- the plain (FULL-only) tree's lock walks: RadixTree's Node (server/tree/node.py), through its slots ---- */
enum { FN_PARENT, FN_LOCK, FN_VALUE, FN_DVER, FN_CHILDREN, FN_KEY, FN_ID, FN_ATIME, FN_LOADING, FN_HVER, FN_HIT,
       FN_PRIO, FN_NS, FN_HASHES, FN_SLOTS };
static const char *const full_names[FN_SLOTS] = {"parent", "lock_ref", "value", "dver", "children", "key", "id",
                                                 "last_access", "loading", "hver", "hit_count", "priority", "ns",
                                                 "hashes"};
static Layout full_layout = {full_names, FN_SLOTS};
#define fget(obj, k) lget(&full_layout, (obj), (k))
#define fnode_add(obj, k, delta, now) ladd(&full_layout, (obj), (k), (delta), (now))

static Py_ssize_t value_tokens(PyObject *node) {  /* len(node.value) >> 2: packed int32 slots */
    PyObject *v = fget(node, FN_VALUE);
    if (v == NULL)
        return -1;
    Py_ssize_t n = PyBytes_Check(v) ? PyBytes_GET_SIZE(v) >> 2 : -1;
    Py_DECREF(v);
    if (n < 0)
        PyErr_SetString(PyExc_TypeError, "a device-locked node's value must be packed slots (bytes)");
    return n;
}

/* full_lock(node, leaves) -> tokens: RadixTree.lock's device walk. Every node from node up to its root, the root
 * included, takes one lock; a node whose count leaves 0 gives its tokens and stops being a D-leaf (out of leaves,
 * its heap entry staled by dver). */
static Py_ssize_t lock_walk(PyObject *node, PyObject *leaves) {
    layout_of(&full_layout, Py_TYPE(node));
    Py_INCREF(node);
    Py_ssize_t newly = 0, lock, ver;
    for (;;) {
        PyObject *parent = fget(node, FN_PARENT);
        if (parent == NULL)
            goto fail;
        if (parent == Py_None) {  /* the namespace root counts locks too, so it is never pruned under one */
            Py_DECREF(parent);
            if (fnode_add(node, FN_LOCK, 1, &lock) < 0)
                goto fail;
            break;
        }
        PyObject *v = fget(node, FN_LOCK);
        Py_ssize_t was = v ? PyLong_AsSsize_t(v) : -1;
        Py_XDECREF(v);
        int r = 0;
        if ((was == -1 && PyErr_Occurred()) || v == NULL)
            r = -1;
        else if (was == 0) {
            Py_ssize_t n = value_tokens(node);
            int gone = n < 0 ? -1 : PySet_Discard(leaves, node);
            r = gone < 0 ? -1 : (gone ? fnode_add(node, FN_DVER, 1, &ver) : 0);
            newly += n;
        }
        if (r < 0 || fnode_add(node, FN_LOCK, 1, &lock) < 0) {
            Py_DECREF(parent);
            goto fail;
        }
        Py_DECREF(node);
        node = parent;
    }
    Py_DECREF(node);
    return newly;
fail:
    Py_DECREF(node);
    return -1;
}

static PyObject *full_lock(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PySet_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "full_lock(node, leaves: set)");
        return NULL;
    }
    Py_ssize_t newly = lock_walk(args[0], args[1]);
    return newly < 0 ? NULL : PyLong_FromSsize_t(newly);
}

/* full_unlock(node) -> (tokens, root): RadixTree._dunlock's walk. Every node from node up to its root, the root
 * included, gives one lock back; tokens: those of the nodes whose count reached 0; root: the root when its count
 * reached 0 (to prune), else None. Of the nodes reaching 0 only node can be a D-leaf (each above it has the
 * device-resident child below it on this path): the caller checks that one. */
static PyObject *unlock_walk(PyObject *node) {
    layout_of(&full_layout, Py_TYPE(node));
    PyObject *root = Py_None;
    Py_INCREF(node);
    Py_ssize_t freed = 0, lock;
    for (;;) {
        PyObject *parent = fget(node, FN_PARENT);
        if (parent == NULL || fnode_add(node, FN_LOCK, -1, &lock) < 0) {
            Py_XDECREF(parent);
            goto fail;
        }
        if (parent == Py_None) {
            Py_DECREF(parent);
            if (lock == 0)
                root = node;
            break;
        }
        if (lock == 0) {
            Py_ssize_t n = value_tokens(node);
            if (n < 0) {
                Py_DECREF(parent);
                goto fail;
            }
            freed += n;
        }
        Py_DECREF(node);
        node = parent;
    }
    PyObject *out = PyTuple_New(2), *fv = out ? PyLong_FromSsize_t(freed) : NULL;
    if (fv == NULL) {
        Py_CLEAR(out);
    } else {
        PyTuple_SET_ITEM(out, 0, fv);
        PyTuple_SET_ITEM(out, 1, Py_NewRef(root));
    }
    Py_DECREF(node);
    return out;
fail:
    Py_DECREF(node);
    return NULL;
}

static PyObject *full_unlock(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 1) {
        PyErr_SetString(PyExc_TypeError, "full_unlock(node)");
        return NULL;
    }
    return unlock_walk(args[0]);
}

static int fnode_set(PyObject *obj, int k, PyObject *v) {  /* steals v */
    int r = v == NULL ? -1 : lset(&full_layout, obj, k, v);
    Py_XDECREF(v);
    return r;
}

/* tree.<name> += delta; the new value into *now (may be NULL). */
static int tree_add(PyObject *tree, PyObject *name, Py_ssize_t delta, Py_ssize_t *now) {
    PyObject *v = tattr(tree, name);
    Py_ssize_t x = v ? PyLong_AsSsize_t(v) : -1;
    Py_XDECREF(v);
    if (x == -1 && PyErr_Occurred())
        return -1;
    if (now != NULL)
        *now = x + delta;
    v = PyLong_FromSsize_t(x + delta);
    int r = v == NULL ? -1 : tset(tree, name, v);
    Py_XDECREF(v);
    return r;
}

/* RadixTree._mint: the next handle, the tree's last one plus one (a new reference; a handle fills 64 unsigned bits). */
static PyObject *tree_mint(PyObject *tree) {
    PyObject *last = tattr(tree, s_handle), *out = NULL;
    unsigned long long h = last == NULL ? (unsigned long long)-1 : PyLong_AsUnsignedLongLong(last);
    Py_XDECREF(last);
    if (h == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    if ((out = PyLong_FromUnsignedLongLong(h + 1)) != NULL && tset(tree, s_handle, out) < 0)
        Py_CLEAR(out);
    return out;
}

/* RadixTree._lazy: 1 when the tree's policy is LRU (ctx[-3], its key function), whose keys only grow. */
static int lazy_lru(PyObject *tree, PyObject *ctx) {
    PyObject *key_of = tattr(tree, s_key_of);
    if (key_of == NULL)
        return -1;
    int lazy = key_of == PyTuple_GET_ITEM(ctx, PyTuple_GET_SIZE(ctx) - 3);
    Py_DECREF(key_of);
    return lazy;
}

/* The leaf heap entry of a node (device, or host), pushed under its current policy key, as RadixTree._add_leaf and
 * _add_hleaf do after their set update: its version bumped (an older entry goes stale), the heap compacted by
 * tree._compact once past slack x live + floor (ctx's last two). ctx[-3]: the LRU policy's key function, whose key
 * (the node's last_access) is read here without calling it. */
static int heap_push(PyObject *tree, PyObject *node, int host, PyObject *leaves, PyObject *ctx) {
    Py_ssize_t ver, seq, n = PyTuple_GET_SIZE(ctx);
    Py_ssize_t slack = PyLong_AsSsize_t(PyTuple_GET_ITEM(ctx, n - 2)), floor = PyLong_AsSsize_t(PyTuple_GET_ITEM(ctx, n - 1));
    PyObject *key_of = NULL, *key = NULL, *entry = NULL, *heap = NULL, *r = NULL;
    int ok = -1;
    if (PyErr_Occurred() || ladd(&full_layout, node, host ? FN_HVER : FN_DVER, 1, &ver) < 0 ||
        tree_add(tree, s_heap_seq, 1, &seq) < 0 || (key_of = tattr(tree, s_key_of)) == NULL)
        goto out;
    if (key_of == PyTuple_GET_ITEM(ctx, n - 3)) {  /* LRU's key, node.last_access, read here: no call */
        key = fget(node, FN_ATIME);
    } else {
        key = PyObject_CallOneArg(key_of, node);
    }
    if (key == NULL || (entry = PyTuple_New(4)) == NULL)
        goto out;
    PyTuple_SET_ITEM(entry, 0, key);  /* the entry owns key from here */
    key = NULL;
    PyTuple_SET_ITEM(entry, 3, Py_NewRef(node));
    PyObject *sv = PyLong_FromSsize_t(seq), *vv = sv ? PyLong_FromSsize_t(ver) : NULL;
    if (vv == NULL) {
        Py_XDECREF(sv);
        goto out;
    }
    PyTuple_SET_ITEM(entry, 1, sv);
    PyTuple_SET_ITEM(entry, 2, vv);
    if ((heap = tattr(tree, host ? s_hheap : s_heap)) == NULL)
        goto out;
    if (!PyList_Check(heap)) {
        PyErr_SetString(PyExc_TypeError, "heap_push: a leaf heap must be a list");
        goto out;
    }
    PyObject *pargs[2] = {heap, entry};
    if ((r = PyObject_Vectorcall(heappush, pargs, 2, NULL)) == NULL)
        goto out;
    Py_DECREF(r);
    r = NULL;
    if (PyList_GET_SIZE(heap) > slack * PySet_GET_SIZE(leaves) + floor &&
        (r = PyObject_CallMethodObjArgs(tree, s_compact, heap, leaves, host ? s_hver : s_dver, NULL)) == NULL)
        goto out;
    ok = 0;
out:
    Py_XDECREF(r);
    Py_XDECREF(heap);
    Py_XDECREF(entry);
    Py_XDECREF(key);
    Py_XDECREF(key_of);
    return ok;
}

/* RadixTree._refresh: a leaf (device, else host) whose policy key changed is pushed again; with device_only, only a
 * D-leaf is (insert's walk). */
static int full_refresh(PyObject *tree, PyObject *node, PyObject *ctx, int device_only) {
    for (int host = 0; host < 2 - device_only; host++) {
        PyObject *leaves = tattr(tree, host ? s_hleaves : s_leaves);
        int in = leaves == NULL ? -1 : PySet_Contains(leaves, node);
        if (in > 0)
            in = heap_push(tree, node, host, leaves, ctx) < 0 ? -1 : 2;
        Py_XDECREF(leaves);
        if (in)
            return in < 0 ? -1 : 0;
    }
    return 0;
}

/* RadixTree's descent along the whole pages of kb[:n]: each whole edge onto path (ntok: its key bytes); an edge the
 * key leaves inside is split through tree._split and its upper part ends the path. With stop_loading (insert), a
 * host-only node being loaded back ends the walk before it (*stopped): that part is the load's to fill. Returns the
 * bytes walked, or -1. */
static Py_ssize_t fdescend(PyObject *tree, PyObject *root, const char *kb, Py_ssize_t n, Py_ssize_t pb,
                           Py_ssize_t page, Path *path, int stop_loading, int *stopped) {
    PyObject *node = root;  /* borrowed: root, then the path's last node */
    Py_ssize_t off = 0;
    *stopped = 0;
    while (off < n) {
        PyObject *children = fget(node, FN_CHILDREN);
        if (children == NULL)
            return -1;
        if (!PyDict_Check(children)) {
            Py_DECREF(children);
            PyErr_SetString(PyExc_TypeError, "descend: children must be a dict");
            return -1;
        }
        PyObject *child = find_child(children, kb + off, pb);
        Py_DECREF(children);
        if (child == NULL)
            return PyErr_Occurred() ? -1 : off;
        PyObject *ck = fget(child, FN_KEY);
        if (ck == NULL || !PyBytes_Check(ck)) {
            Py_XDECREF(ck);
            Py_DECREF(child);
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_TypeError, "descend: a node's key must be bytes");
            return -1;
        }
        Py_ssize_t cl = PyBytes_GET_SIZE(ck), step = cl;
        const char *a = PyBytes_AS_STRING(ck);
        int whole = off + cl <= n && cl >= pb && memcmp(a + pb, kb + off + pb, (size_t)(cl - pb)) == 0;
        if (!whole) {  /* page-aligned common prefix (the first page is equal: the dict's key), then split there */
            Py_ssize_t ntok = (cl < n - off ? cl : n - off) / 4, i = pb / 4;
            while (i < ntok && memcmp(a + 4 * i, kb + off + 4 * i, 4) == 0)
                i++;
            step = (i - i % page) * 4;
            Py_DECREF(ck);
            PyObject *upper = PyObject_CallMethod(tree, "_split", "On", child, step);  /* rare: by name */
            Py_DECREF(child);
            if (upper == NULL)
                return -1;
            child = upper;
        } else {
            Py_DECREF(ck);
        }
        if (stop_loading) {
            PyObject *v = fget(child, FN_VALUE), *ld = v == Py_None ? fget(child, FN_LOADING) : NULL;
            int busy = ld == NULL ? 0 : PyObject_IsTrue(ld);
            Py_XDECREF(ld);
            Py_XDECREF(v);
            if (v == NULL || busy < 0 || (v == Py_None && ld == NULL)) {
                Py_DECREF(child);
                return -1;
            }
            if (busy) {
                Py_DECREF(child);
                *stopped = 1;
                return off;
            }
        }
        if (path_push(path, child, step) < 0)
            return -1;
        off += step;
        node = child;
        if (!whole)
            break;
    }
    return off;
}

/* full_descend(tree, root, key, n, page_bytes) -> (path, tail) or NotImplemented for a key to pack first.
 * RadixTree.insert's descent (fdescend with stop_loading) along key's first n bytes (whole pages); tail: the key's
 * bytes past the walk, packed for a new leaf, or None (walked to the end, or stopped by a load). */
static PyObject *full_descend(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "full_descend(tree, root, key, n, page_bytes)");
        return NULL;
    }
    PyObject *tree = args[0], *root = args[1];
    layout_of(&full_layout, Py_TYPE(root));
    Py_ssize_t n = PyLong_AsSsize_t(args[3]), pb = PyLong_AsSsize_t(args[4]);
    if (PyErr_Occurred())
        return NULL;
    if (pb <= 0 || pb % 4) {
        PyErr_Format(PyExc_ValueError, "full_descend: page of %zd bytes", pb);
        return NULL;
    }
    Py_buffer key;
    int got = read_key(args[2], &key);
    if (got <= 0)
        return got < 0 ? NULL : Py_NewRef(Py_NotImplemented);
    PyObject *out = NULL, *list = NULL, *tail = NULL;
    Path path;
    path_init(&path);
    if (n < 0 || n > key.len || n % pb) {
        PyErr_Format(PyExc_ValueError, "full_descend: %zd bytes of a %zd-byte key, pages of %zd", n, key.len, pb);
        goto done;
    }
    int stopped;
    Py_ssize_t off = fdescend(tree, root, key.buf, n, pb, pb / 4, &path, 1, &stopped);
    if (off < 0 || (list = PyList_New(path.len)) == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < path.len; i++)
        PyList_SET_ITEM(list, i, Py_NewRef(path.node[i]));
    tail = off < n && !stopped ? PyBytes_FromStringAndSize((const char *)key.buf + off, n - off) : Py_NewRef(Py_None);
    if (tail != NULL)
        out = PyTuple_Pack(2, list, tail);
done:
    int64_release(&key);
    Py_XDECREF(list);
    Py_XDECREF(tail);
    path_free(&path);
    return out;
}

/* key_tokens(key) -> tokens in key read in place, or -1: a key full_descend would not read (pack it first). */
static PyObject *key_tokens(PyObject *Py_UNUSED(self), PyObject *key) {
    Py_buffer view;
    int got = read_key(key, &view);
    if (got < 0)
        return NULL;
    Py_ssize_t n = got ? view.len / 4 : -1;
    if (got)
        int64_release(&view);
    return PyLong_FromSsize_t(n);
}

static const char *const insert_names[] = {"prefix_len", "node_id", "duplicates", "adopted_len", "tail",
                                           "unevicted_len", "backups"};
static Layout insert_layout = {insert_names, 7};
static const char *const icounter_names[] = {"inserted_tokens"};
static Layout icounters_layout = {icounter_names, 1};

/* A new bytes object holding len bytes of src. A long one (a new leaf's key and slots: tens of KB a prompt) is written
 * with streaming stores: its memory is fresh, so a plain copy would first read every line of it from RAM. */
static PyObject *bytes_cold(const char *src, Py_ssize_t len) {
#if defined(__SSE2__)
    if (len >= 16384) {
        PyObject *b = PyBytes_FromStringAndSize(NULL, len);
        if (b == NULL)
            return NULL;
        char *dst = PyBytes_AS_STRING(b);
        Py_ssize_t head = (Py_ssize_t)((16 - ((uintptr_t)dst & 15)) & 15), i = head;
        memcpy(dst, src, (size_t)head);
        for (; i + 64 <= len; i += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)(src + i)), c = _mm_loadu_si128((const __m128i *)(src + i + 16)),
                    d = _mm_loadu_si128((const __m128i *)(src + i + 32)), e = _mm_loadu_si128((const __m128i *)(src + i + 48));
            _mm_stream_si128((__m128i *)(dst + i), a);
            _mm_stream_si128((__m128i *)(dst + i + 16), c);
            _mm_stream_si128((__m128i *)(dst + i + 32), d);
            _mm_stream_si128((__m128i *)(dst + i + 48), e);
        }
        memcpy(dst + i, src + i, (size_t)(len - i));
        _mm_sfence();
        return b;
    }
#endif
    return PyBytes_FromStringAndSize(src, len);
}

/* Node(id, parent, key, value, tick, priority, ns) without running its Python __init__: a fresh instance of the
 * class whose every slot is set as __init__ sets it. Learned once from a probe instance made by the class itself with
 * arguments no other slot could hold: a slot holding an argument takes that argument, `children` a new empty dict,
 * and every other slot the probe's own value, which must be an int, a bool or None (shared safely) and the same in
 * a second probe made with other arguments (not derived from them). A class that does anything else (another
 * mutable default, a value computed from its arguments, an argument stored twice or not at all, a __dict__) keeps
 * its __init__. */
#define NODE_MAX_SLOTS 32
static const char *const node_arg_names[] = {"id", "parent", "key", "value", "last_access", "priority", "ns",
                                             "created", "children"};
static const int node_arg_of[] = {0, 1, 2, 3, 4, 5, 6, 4, -1};  /* the argument each of those slots takes */
typedef struct {
    PyTypeObject *tp;  /* learned for this class (NULL: not yet) */
    int usable, n;
    Py_ssize_t off[NODE_MAX_SLOTS];
    int arg[NODE_MAX_SLOTS];      /* -1: a new dict; -2: the constant below; else the argument's index */
    PyObject *value[NODE_MAX_SLOTS];
} NodeTemplate;
static NodeTemplate node_tpl;  /* the tree's Node class (the first class make_node sees) */

static void learn_node(NodeTemplate *tpl, PyTypeObject *tp) {
    NodeTemplate t;  /* filled here, then copied out */
    memset(&t, 0, sizeof(t));
    t.tp = tp;
    Py_INCREF(tp);
    *tpl = t;
    if (!(tp->tp_flags & Py_TPFLAGS_HEAPTYPE) || tp->tp_dictoffset != 0 || tp->tp_members == NULL ||
        tp->tp_alloc == NULL)
        return;
    /* two probes with different arguments: a slot __init__ derives from its arguments differs between them */
    PyObject *probe_args[7] = {PyLong_FromLongLong(1LL << 52), Py_NewRef(Py_None), PyBytes_FromString("probe key"),
                               PyBytes_FromString("probe value"), PyLong_FromLongLong((1LL << 52) + 1),
                               PyLong_FromLongLong((1LL << 52) + 2), PyTuple_Pack(1, Py_None)};
    PyObject *other_args[7] = {PyLong_FromLongLong(3LL << 52), Py_NewRef(Py_None),
                               PyBytes_FromString("another, longer probe key"), PyBytes_FromString("v"),
                               PyLong_FromLongLong((3LL << 52) + 5), PyLong_FromLong(-7), PyTuple_Pack(2, Py_None, Py_None)};
    PyObject *probe = NULL, *other = NULL;
    int ok = 1;
    for (int i = 0; i < 7; i++)
        ok &= probe_args[i] != NULL && other_args[i] != NULL;
    if (ok && (probe = PyObject_Vectorcall((PyObject *)tp, probe_args, 7, NULL)) != NULL)
        other = PyObject_Vectorcall((PyObject *)tp, other_args, 7, NULL);
    ok = probe != NULL && Py_TYPE(probe) == tp && other != NULL && Py_TYPE(other) == tp;
    int seen[9] = {0};
    for (PyMemberDef *m = tp->tp_members; ok && m->name != NULL; m++) {
        if (m->type != T_OBJECT_EX || (m->flags & READONLY) || t.n == NODE_MAX_SLOTS) {
            ok = 0;
            break;
        }
        PyObject *v = *at(probe, m->offset);
        int k = t.n, named = -1;
        for (int j = 0; j < 9; j++)
            if (strcmp(m->name, node_arg_names[j]) == 0)
                named = j;
        t.off[k] = m->offset;
        t.value[k] = NULL;
        if (named >= 0) {
            int a = node_arg_of[named];
            seen[named]++;
            PyObject *w = *at(other, m->offset);
            ok = a < 0 ? v != NULL && PyDict_CheckExact(v) && PyDict_GET_SIZE(v) == 0 && w != v && w != NULL &&
                             PyDict_CheckExact(w)
                       : v == probe_args[a] && w == other_args[a];
            t.arg[k] = a;
        } else {
            for (int a = 0; a < 7; a++)  /* None (the probe's parent) is a default too */
                ok &= a == 1 || v != probe_args[a];
            PyObject *w = *at(other, m->offset);
            ok &= v != NULL && (v == Py_None || PyBool_Check(v) || PyLong_CheckExact(v)) && w != NULL &&
                  Py_TYPE(w) == Py_TYPE(v) && PyObject_RichCompareBool(v, w, Py_EQ) == 1;
            t.arg[k] = -2;
            t.value[k] = Py_XNewRef(v);
        }
        t.n++;
    }
    for (int j = 0; j < 9; j++)
        ok &= seen[j] == 1;
    t.usable = ok;
    *tpl = t;
    Py_XDECREF(probe);
    Py_XDECREF(other);
    for (int i = 0; i < 7; i++) {
        Py_XDECREF(probe_args[i]);
        Py_XDECREF(other_args[i]);
    }
    PyErr_Clear();
}

static PyObject *make_node(PyObject *cls, PyObject *const *args) {  /* Node(*args[:7]) */
    PyTypeObject *tp = (PyTypeObject *)cls;
    if (node_tpl.tp == NULL && PyType_Check(cls))
        learn_node(&node_tpl, tp);
    if (node_tpl.tp != tp || !node_tpl.usable)
        return PyObject_Vectorcall(cls, args, 7, NULL);
    PyObject *children = PyDict_New(), *node = children ? tp->tp_alloc(tp, 0) : NULL;
    if (node == NULL) {
        Py_XDECREF(children);
        return NULL;
    }
    for (int k = 0; k < node_tpl.n; k++) {
        int a = node_tpl.arg[k];
        *at(node, node_tpl.off[k]) = a == -1 ? Py_NewRef(children) : Py_NewRef(a == -2 ? node_tpl.value[k] : args[a]);
    }
    Py_DECREF(children);
    return node;
}

/* A new leaf under parent (RadixTree.insert's tail, device only): id minted, the next tick, in parent's children, the
 * node index and the D-leaf set; parent leaves that set; evictable tokens grow; a STORED event when events are on. */
static PyObject *new_leaf(PyObject *tree, PyObject *parent, const char *kb, const char *vb, Py_ssize_t len,
                          Py_ssize_t pb, Py_ssize_t tick, PyObject *priority, int chunked, PyObject *ns,
                          PyObject *ctx) {
    Py_ssize_t ver;
    PyObject *id = tree_mint(tree), *key = NULL, *val = NULL, *leaf = NULL, *first = NULL, *children = NULL,
             *nodes = NULL, *leaves = NULL, *ev = NULL, *out = NULL;
    if (id == NULL || (key = bytes_cold(kb, len)) == NULL || (val = bytes_cold(vb, len)) == NULL ||
        (first = PyBytes_FromStringAndSize(kb, pb)) == NULL)
        goto done;
    PyObject *targs[7] = {id, parent, key, val, NULL, priority, ns};
    if ((targs[4] = PyLong_FromSsize_t(tick)) == NULL)
        goto done;
    leaf = make_node(PyTuple_GET_ITEM(ctx, 1), targs);
    Py_DECREF(targs[4]);
    if (leaf == NULL || (children = fget(parent, FN_CHILDREN)) == NULL || PyDict_SetItem(children, first, leaf) < 0 ||
        (nodes = tattr(tree, s_nodes)) == NULL || PyDict_SetItem(nodes, id, leaf) < 0 ||
        tree_add(tree, s_evictable, len / 4, NULL) < 0 || (leaves = tattr(tree, s_leaves)) == NULL)
        goto done;
    int in = PySet_Discard(leaves, parent);  /* RadixTree._drop_leaf(parent) */
    if (in < 0 || (in && ladd(&full_layout, parent, FN_DVER, 1, &ver) < 0))
        goto done;
    if (!chunked && fnode_set(leaf, FN_HIT, PyLong_FromLong(1)) < 0)
        goto done;
    if (PySet_Add(leaves, leaf) < 0 || heap_push(tree, leaf, 0, leaves, ctx) < 0 ||  /* RadixTree._add_leaf */
        (ev = tattr(tree, s_ev)) == NULL)
        goto done;
    if (ev != Py_None) {
        PyObject *r = PyObject_CallMethodObjArgs(tree, s_stored, leaf, PyTuple_GET_ITEM(ctx, 2), NULL);
        if (r == NULL)
            goto done;
        Py_DECREF(r);
    }
    out = Py_NewRef(leaf);
done:
    Py_XDECREF(id);
    Py_XDECREF(key);
    Py_XDECREF(val);
    Py_XDECREF(first);
    Py_XDECREF(leaf);
    Py_XDECREF(children);
    Py_XDECREF(nodes);
    Py_XDECREF(leaves);
    Py_XDECREF(ev);
    return out;
}

/* full_insert(tree, root, key, vals, n, prev, priority, chunked, ns, ctx) -> InsertResult, or NotImplemented for
 * slots not read in place (a contiguous int32 vector or bytes; nothing was touched). RadixTree.insert for a tree
 * without a host tier, after its checks: the descent along key's first n bytes, each walked node's tick, priority,
 * hit and leaf entry, the duplicate slots (those walked past prev, copied), the new leaf, the counter, the result.
 * ctx: (InsertResult, Node, GPU, empty, int32 dtype, no slots, LRU key, heap slack, heap floor). */
static PyObject *insert_impl(PyObject *tree, PyObject *root, PyObject *vals_obj, Py_buffer key, Py_buffer vals,
                             Py_ssize_t n, Py_ssize_t prev, PyObject *priority, int chunked, PyObject *ns,
                             PyObject *ctx);

static PyObject *full_insert(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 10 || !PyTuple_Check(args[9]) || PyTuple_GET_SIZE(args[9]) != 9) {
        PyErr_SetString(PyExc_TypeError, "full_insert(tree, root, key, vals, n, prev, priority, chunked, ns, ctx: "
                                         "(InsertResult, Node, GPU, empty, int32, no_slots, lru_key, heap_slack, "
                                         "heap_floor))");
        return NULL;
    }
    Py_ssize_t n = PyLong_AsSsize_t(args[4]), prev = PyLong_AsSsize_t(args[5]);
    int chunked = PyObject_IsTrue(args[7]);
    if (PyErr_Occurred() || chunked < 0)
        return NULL;
    Py_buffer key, vals;
    int got = read_key(args[2], &key);
    if (got <= 0)
        return got < 0 ? NULL : Py_NewRef(Py_NotImplemented);
    if ((got = read_key(args[3], &vals)) <= 0) {
        int64_release(&key);
        return got < 0 ? NULL : Py_NewRef(Py_NotImplemented);
    }
    return insert_impl(args[0], args[1], args[3], key, vals, n, prev, args[6], chunked, args[8], args[9]);
}

/* full_insert's work on keys read in place (both views released here); vals_obj: the slots' own object. */
static PyObject *insert_impl(PyObject *tree, PyObject *root, PyObject *vals_obj, Py_buffer key, Py_buffer vals,
                             Py_ssize_t n, Py_ssize_t prev, PyObject *priority, int chunked, PyObject *ns,
                             PyObject *ctx) {
    layout_of(&full_layout, Py_TYPE(root));
    PyObject *pbo = tattr(tree, s_page_b);
    Py_ssize_t pb = pbo ? PyLong_AsSsize_t(pbo) : -1;
    Py_XDECREF(pbo);
    PyObject *out = NULL, *counters = NULL, *dup = NULL, *node = root, *leaf = NULL;  /* node: borrowed */
    Path path;
    path_init(&path);
    if (PyErr_Occurred())
        goto done;
    if (pb <= 0 || pb % 4 || n < 0 || n > key.len || n % pb || n > vals.len || prev < 0 || 4 * prev > n) {
        PyErr_Format(PyExc_ValueError, "full_insert: %zd bytes of a %zd-byte key, %zd of slots, pages of %zd, "
                                       "prev %zd", n, key.len, vals.len, pb, prev);
        goto done;
    }
    int stopped;
    Py_ssize_t off = fdescend(tree, root, key.buf, n, pb, pb / 4, &path, 0, &stopped), tick;
    PyObject *tv = off < 0 ? NULL : tattr(tree, s_tick);
    tick = tv ? PyLong_AsSsize_t(tv) : -1;
    Py_XDECREF(tv);
    if (tick == -1 && PyErr_Occurred())
        goto done;
    for (Py_ssize_t i = 0; i < path.len; i++) {
        PyObject *nd = path.node[i], *v = fget(nd, FN_VALUE), *p = v ? fget(nd, FN_PRIO) : NULL;
        Py_XDECREF(v);
        if (p == NULL)
            goto done;
        int higher = v == Py_None ? -1 : PyObject_RichCompareBool(priority, p, Py_GT);
        Py_DECREF(p);
        if (higher < 0) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_RuntimeError, "full_insert: a node without device slots in a device-only tree");
            goto done;
        }
        Py_ssize_t hits;
        if (fnode_set(nd, FN_ATIME, PyLong_FromSsize_t(++tick)) < 0 ||
            (higher && fnode_set(nd, FN_PRIO, Py_NewRef(priority)) < 0) ||
            (!chunked && ladd(&full_layout, nd, FN_HIT, 1, &hits) < 0) || full_refresh(tree, nd, ctx, 1) < 0)
            goto done;
        node = nd;
    }
    Py_ssize_t from = 4 * prev < off ? 4 * prev : off;  /* the walked slots past prev come back as duplicates */
    if (from == off) {
        dup = Py_NewRef(PyTuple_GET_ITEM(ctx, 5));
    } else {
        Py_buffer w;
        if ((dup = new_vector((off - from) / 4, 0, PyTuple_GET_ITEM(ctx, 3), PyTuple_GET_ITEM(ctx, 4))) == NULL ||
            PyObject_GetBuffer(dup, &w, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
            goto done;
        memcpy(w.buf, (const char *)vals.buf + from, (size_t)(off - from));
        PyBuffer_Release(&w);
    }
    Py_ssize_t walked = off;
    if (off < n) {
        if ((leaf = new_leaf(tree, node, (const char *)key.buf + off, (const char *)vals.buf + off, n - off, pb,
                             ++tick, priority, chunked, ns, ctx)) == NULL)
            goto done;
        node = leaf;
        off = n;
    }
    tv = PyLong_FromSsize_t(tick);
    int r = tv == NULL ? -1 : tset(tree, s_tick, tv);
    Py_XDECREF(tv);
    if (r < 0 || (counters = tattr(tree, s_counters)) == NULL)
        goto done;
    Py_ssize_t now;
    layout_of(&icounters_layout, Py_TYPE(counters));
    if (ladd(&icounters_layout, counters, 0, (off - walked) / 4, &now) < 0)
        goto done;
    PyObject *res[7] = {PyLong_FromSsize_t(walked / 4), fget(node, FN_ID), dup,
                        PyLong_FromSsize_t((off - walked) / 4), tail_of(vals_obj, off / 4),
                        PyLong_FromLong(0), PyTuple_New(0)};
    dup = NULL;
    out = make_result(&insert_layout, PyTuple_GET_ITEM(ctx, 0), res, 7);
done:
    int64_release(&key);
    int64_release(&vals);
    Py_XDECREF(counters);
    Py_XDECREF(dup);
    Py_XDECREF(leaf);
    path_free(&path);
    return out;
}

/* RadixTree._is_leaf: a device-resident, unlocked non-root node without a device-resident child. */
static int is_dleaf(PyObject *node) {
    PyObject *parent = fget(node, FN_PARENT), *lock = parent ? fget(node, FN_LOCK) : NULL,
             *value = lock ? fget(node, FN_VALUE) : NULL, *children = value ? fget(node, FN_CHILDREN) : NULL;
    int out = -1;
    if (children == NULL)
        goto done;
    if (!PyDict_Check(children)) {
        PyErr_SetString(PyExc_TypeError, "is_dleaf: children must be a dict");
        goto done;
    }
    out = parent != Py_None && PyLong_Check(lock) && PyLong_AsSsize_t(lock) == 0 && value != Py_None;
    Py_ssize_t pos = 0;
    PyObject *k, *c;
    while (out == 1 && PyDict_Next(children, &pos, &k, &c)) {  /* any device-resident child? */
        PyObject *cv = fget(c, FN_VALUE);
        if (cv == NULL)
            out = -1;
        else if (cv != Py_None)
            out = 0;
        Py_XDECREF(cv);
    }
done:
    Py_XDECREF(parent);
    Py_XDECREF(lock);
    Py_XDECREF(value);
    Py_XDECREF(children);
    return out;
}

static int tree_move(PyObject *tree, Py_ssize_t tokens) {  /* evictable -> protected (tokens < 0: back) */
    return tokens == 0 ? 0 : (tree_add(tree, s_evictable, -tokens, NULL) < 0 || tree_add(tree, s_protected, tokens, NULL) < 0) ? -1 : 0;
}

/* lock_handle(tree, node_id) -> receipt: RadixTree.lock for a device-resident node, called as tree.lock when the tree is
 * native (no Python frame on the hot path): the node looked up, a receipt minted, the device walk, the sizes, the
 * receipt recorded. Anything else (a stale, foreign or host-only node) goes to the Python method, which raises or
 * host-locks. */
static PyObject *lock_impl(PyObject *tree, PyObject *node_id) {
    PyObject *nodes = tattr(tree, s_nodes), *node = NULL, *value = NULL;
    if (nodes == NULL)
        return NULL;
    node = PyDict_Check(nodes) && PyLong_CheckExact(node_id) ? PyDict_GetItemWithError(nodes, node_id) : NULL;
    Py_XINCREF(node);
    Py_DECREF(nodes);
    if (node != NULL) {
        layout_of(&full_layout, Py_TYPE(node));
        value = fget(node, FN_VALUE);
    }
    if (PyErr_Occurred()) {
        Py_XDECREF(node);
        Py_XDECREF(value);
        return NULL;
    }
    if (node == NULL || value == Py_None) {  /* the rare cases: the reference raises or host-locks */
        Py_XDECREF(node);
        Py_XDECREF(value);
        return PyObject_CallMethodObjArgs((PyObject *)Py_TYPE(tree), s_lock, tree, node_id, NULL);
    }
    Py_DECREF(value);
    PyObject *receipt = tree_mint(tree), *leaves = NULL, *receipts = NULL, *entry = NULL;
    Py_ssize_t newly;
    if (receipt == NULL || (leaves = tattr(tree, s_leaves)) == NULL)
        goto done;
    if (!PySet_Check(leaves)) {
        PyErr_SetString(PyExc_TypeError, "lock_handle: the leaf set must be a set");
        goto done;
    }
    if ((newly = lock_walk(node, leaves)) < 0 || tree_move(tree, newly) < 0 ||
        (receipts = tattr(tree, s_receipts)) == NULL || (entry = PyTuple_Pack(2, node, Py_None)) == NULL ||
        PyObject_SetItem(receipts, receipt, entry) < 0)
        Py_CLEAR(receipt);
done:
    Py_XDECREF(leaves);
    Py_XDECREF(receipts);
    Py_XDECREF(entry);
    Py_DECREF(node);
    return receipt;
}

/* unlock_handle(tree, receipt) -> None: RadixTree.unlock for a receipt on a device-resident node alone, called as
 * tree.unlock when the tree is native: the receipt dropped, the device walk back, the sizes, the anchor back among the
 * D-leaves if it became one, an emptied namespace root pruned. Anything else goes to the Python method. */
static PyObject *unlock_impl(PyObject *tree, PyObject *receipt) {
    PyObject *receipts = tattr(tree, s_receipts), *entry = NULL;
    if (receipts == NULL)
        return NULL;
    if (PyDict_Check(receipts) && PyLong_CheckExact(receipt)) {
        entry = PyDict_GetItemWithError(receipts, receipt);
        Py_XINCREF(entry);
    }
    if (entry == NULL || !PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) != 2 ||
        PyTuple_GET_ITEM(entry, 1) != Py_None) {  /* unknown, or host-anchored: the reference raises or unlocks */
        Py_DECREF(receipts);
        Py_XDECREF(entry);
        return PyErr_Occurred() ? NULL
                                : PyObject_CallMethodObjArgs((PyObject *)Py_TYPE(tree), s_unlock, tree, receipt, NULL);
    }
    PyObject *node = PyTuple_GET_ITEM(entry, 0), *out = NULL, *walk = NULL;
    layout_of(&full_layout, Py_TYPE(node));
    if (PyDict_DelItem(receipts, receipt) < 0 || (walk = unlock_walk(node)) == NULL)
        goto done;
    Py_ssize_t freed = PyLong_AsSsize_t(PyTuple_GET_ITEM(walk, 0));
    PyObject *root = PyTuple_GET_ITEM(walk, 1);
    int leaf = PyErr_Occurred() || tree_move(tree, -freed) < 0 ? -1 : is_dleaf(node);
    if (leaf < 0)
        goto done;
    if (leaf) {  /* RadixTree._add_leaf */
        PyObject *leaves = tattr(tree, s_leaves);
        int r = leaves == NULL || PySet_Add(leaves, node) < 0 ? -1 : 0;
        PyObject *ctx = r < 0 ? NULL : tattr(tree, s_mctx);
        r = ctx == NULL || !PyTuple_Check(ctx) || PyTuple_GET_SIZE(ctx) < 3 ? -1 : heap_push(tree, node, 0, leaves, ctx);
        Py_XDECREF(ctx);
        Py_XDECREF(leaves);
        if (r < 0) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_TypeError, "unlock_handle: tree._mctx must end with the LRU key and the heap bounds");
            goto done;
        }
    }
    PyObject *below = root == Py_None ? NULL : fget(root, FN_CHILDREN);
    int bare = below == NULL ? (root == Py_None ? 0 : -1) : !PyDict_Check(below) || PyDict_GET_SIZE(below) == 0;
    Py_XDECREF(below);
    if (bare < 0)
        goto done;
    if (bare) {  /* RadixTree._prune_root decides the rest: a root with children is never pruned */
        PyObject *r = PyObject_CallMethodObjArgs(tree, s_prune_root, root, NULL);
        if (r == NULL)
            goto done;
        Py_DECREF(r);
    }
    out = Py_NewRef(Py_None);
done:
    Py_XDECREF(walk);
    Py_DECREF(entry);
    Py_DECREF(receipts);
    return out;
}

static PyObject *lock_handle(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "lock_handle(tree, node_id)");
        return NULL;
    }
    return lock_impl(args[0], args[1]);
}

static PyObject *unlock_handle(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "unlock_handle(tree, receipt)");
        return NULL;
    }
    return unlock_impl(args[0], args[1]);
}

/* The same two bound to one tree as builtin methods (their self is the tree): a call goes straight to the C function,
 * where functools.partial copied its arguments into a new vector first. */
static PyObject *bound_lock(PyObject *tree, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 1) {
        PyErr_SetString(PyExc_TypeError, "lock(node_id)");
        return NULL;
    }
    return lock_impl(tree, args[0]);
}

static PyObject *bound_unlock(PyObject *tree, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 1) {
        PyErr_SetString(PyExc_TypeError, "unlock(receipt)");
        return NULL;
    }
    return unlock_impl(tree, args[0]);
}

static PyMethodDef bound_defs[] = {
    {"lock", (PyCFunction)(void (*)(void))bound_lock, METH_FASTCALL, "RadixTree.lock, native (see lock_handle)."},
    {"unlock", (PyCFunction)(void (*)(void))bound_unlock, METH_FASTCALL,
     "RadixTree.unlock, native (see unlock_handle)."},
};

/* RadixTree.insert bound to a native tree without a host tier or bigram keys (tree.insert): the common call, keys and
 * slots read in place, goes straight to insert_impl; anything else (another argument type, a slot count that does
 * not fit, prev_prefix_len, a namespace not seen yet, a bad argument) to the method, which checks and raises. */
static PyObject *s_insert, *insert_kw[4], *default_ns, *s_zero;

static PyObject *bound_insert(PyObject *tree, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf), nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    PyObject *opt[4] = {default_ns, NULL, NULL, NULL};  /* namespace, prev_prefix_len, priority, chunked */
    int fast = nargs >= 2 && nargs <= 6;
    for (Py_ssize_t i = 2; i < nargs && fast; i++)
        opt[i - 2] = args[i];
    for (Py_ssize_t k = 0; k < nkw && fast; k++) {
        PyObject *name = PyTuple_GET_ITEM(kwnames, k);
        int at_ = -1;
        for (int j = 0; j < 4 && at_ < 0; j++)
            if (name == insert_kw[j] || PyUnicode_Compare(name, insert_kw[j]) == 0)
                at_ = j;
        fast = at_ >= 0 && at_ + 2 >= nargs;  /* a name the method knows, not given twice */
        if (fast)
            opt[at_] = args[nargs + k];
    }
    PyObject *root = NULL, *ctx = NULL, *roots = NULL;
    int chunked = 0;
    fast = fast && (opt[1] == NULL || (PyLong_CheckExact(opt[1]) && PyLong_AsSsize_t(opt[1]) == 0)) &&
           (opt[2] == NULL || PyLong_CheckExact(opt[2])) && (opt[3] == NULL || (chunked = PyObject_IsTrue(opt[3])) >= 0);
    if (fast && (roots = tattr(tree, s_roots)) != NULL && PyDict_CheckExact(roots))
        root = PyDict_GetItemWithError(roots, opt[0]);  /* borrowed; NULL: a namespace the method creates */
    if (root != NULL && (ctx = tattr(tree, s_ictx)) != NULL &&
        (!PyTuple_CheckExact(ctx) || PyTuple_GET_SIZE(ctx) != 9))
        Py_CLEAR(ctx);
    PyErr_Clear();
    Py_buffer key, vals;
    int got = ctx != NULL && Py_TYPE(args[1]) == np_type ? read_key(args[0], &key) : 0;
    if (got > 0 && (got = read_key(args[1], &vals)) <= 0)
        int64_release(&key);
    if (got > 0 && vals.len != key.len) {  /* the method says why */
        int64_release(&key);
        int64_release(&vals);
        got = 0;
    }
    PyObject *out = NULL;
    if (got > 0) {
        PyObject *pbo = tattr(tree, s_page_b);
        Py_ssize_t pb = pbo && PyLong_Check(pbo) ? PyLong_AsSsize_t(pbo) : 0;
        Py_XDECREF(pbo);
        PyErr_Clear();
        if (pb > 0) {
            Py_INCREF(root);  /* held across the insert, which may prune nothing but is no place to borrow */
            out = insert_impl(tree, root, args[1], key, vals, key.len - key.len % pb, 0,
                              opt[2] ? opt[2] : s_zero, chunked,
                              opt[0], ctx);
            Py_DECREF(root);
        } else {
            int64_release(&key);
            int64_release(&vals);
            got = 0;
        }
    }
    Py_XDECREF(roots);
    Py_XDECREF(ctx);
    if (got > 0)
        return out;  /* insert_impl's result or its error */
    PyErr_Clear();
    PyObject *stack[16], *fn = _PyType_Lookup(Py_TYPE(tree), s_insert);  /* borrowed */
    if (fn == NULL || nargs + nkw + 1 > 16) {
        PyErr_SetString(PyExc_TypeError, "insert(tokens, values, namespace, prev_prefix_len, priority, chunked)");
        return NULL;
    }
    stack[0] = tree;
    for (Py_ssize_t i = 0; i < nargs + nkw; i++)
        stack[i + 1] = args[i];
    return PyObject_Vectorcall(fn, stack, (size_t)(nargs + 1), kwnames);
}

static PyMethodDef insert_def = {"insert", (PyCFunction)(void (*)(void))bound_insert, METH_FASTCALL | METH_KEYWORDS,
                                 "RadixTree.insert, native (see bound_insert)."};

static PyObject *bind_insert(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "bind_insert(tree, default_namespace)");
        return NULL;
    }
    Py_XSETREF(default_ns, Py_NewRef(args[1]));
    return PyCFunction_New(&insert_def, args[0]);
}

static PyObject *bind_locks(PyObject *Py_UNUSED(self), PyObject *tree) {
    PyObject *lock = PyCFunction_New(&bound_defs[0], tree);
    PyObject *unlock = lock ? PyCFunction_New(&bound_defs[1], tree) : NULL;
    PyObject *out = unlock ? PyTuple_Pack(2, lock, unlock) : NULL;
    Py_XDECREF(lock);
    Py_XDECREF(unlock);
    return out;
}

static const char *const evict_names[] = {"freed", "evicted_tokens", "write_backs", "demoted_tokens", "spilled"};
static Layout evict_layout = {evict_names, 5};
static const char *const ecounter_names[] = {"evicted_tokens_device"};
static Layout ecounters_layout = {ecounter_names, 1};

/* One D-leaf out of the tree (RadixTree._evict_device_only's loop body): out of the leaf set, its parent's children
 * and the node index, its entry staled; its span onto gone (events on); its parent a D-leaf in turn, or an emptied
 * namespace root dropped. Its value (a new reference) into *value. */
static int evict_leaf(PyObject *tree, PyObject *node, PyObject *leaves, PyObject *nodes, PyObject *gone, Py_ssize_t pb,
                      PyObject *ctx, PyObject **value) {
    PyObject *parent = NULL, *key = NULL, *first = NULL, *children = NULL, *id = NULL, *plock = NULL,
             *pparent = NULL, *ns = NULL;
    Py_ssize_t ver;
    int ok = -1;
    *value = NULL;
    if (gone != NULL) {
        PyObject *span = fget(node, FN_HASHES);
        if (span == Py_None) {
            Py_DECREF(span);
            span = PyObject_CallMethodOneArg(tree, s_span, node);
        }
        int r = span == NULL ? -1 : PyList_Append(gone, span);
        Py_XDECREF(span);
        if (r < 0)
            return -1;
    }
    if (PySet_Discard(leaves, node) < 0 || (parent = fget(node, FN_PARENT)) == NULL ||
        (key = fget(node, FN_KEY)) == NULL)
        goto done;
    if (!PyBytes_Check(key) || PyBytes_GET_SIZE(key) < pb) {
        PyErr_SetString(PyExc_TypeError, "evict: a node's key must be bytes of whole pages");
        goto done;
    }
    if ((first = PyBytes_FromStringAndSize(PyBytes_AS_STRING(key), pb)) == NULL ||
        (children = fget(parent, FN_CHILDREN)) == NULL || PyObject_DelItem(children, first) < 0 ||
        (id = fget(node, FN_ID)) == NULL || PyObject_DelItem(nodes, id) < 0 ||
        ladd(&full_layout, node, FN_DVER, 1, &ver) < 0 || (*value = fget(node, FN_VALUE)) == NULL)
        goto done;
    if (!PyBytes_Check(*value)) {
        PyErr_SetString(PyExc_TypeError, "evict: a D-leaf's value must be packed slots (bytes)");
        goto done;
    }
    if (PyDict_GET_SIZE(children) == 0) {  /* an emptied, unlocked parent: a D-leaf now, or a root to drop */
        if ((plock = fget(parent, FN_LOCK)) == NULL || (pparent = fget(parent, FN_PARENT)) == NULL)
            goto done;
        int unlocked = PyLong_Check(plock) && PyLong_AsSsize_t(plock) == 0;
        if (unlocked && pparent != Py_None) {
            if (PySet_Add(leaves, parent) < 0 || heap_push(tree, parent, 0, leaves, ctx) < 0)
                goto done;
        } else if (unlocked) {
            if ((ns = fget(parent, FN_NS)) == NULL)
                goto done;
            int dflt = PyObject_RichCompareBool(ns, PyTuple_GET_ITEM(ctx, 1), Py_EQ);
            if (dflt < 0)
                goto done;
            if (!dflt) {
                PyObject *roots = tattr(tree, s_roots), *pid = fget(parent, FN_ID);
                int r = roots == NULL || pid == NULL || PyObject_DelItem(roots, ns) < 0 ||
                        PyObject_DelItem(nodes, pid) < 0 ? -1 : 0;
                Py_XDECREF(roots);
                Py_XDECREF(pid);
                if (r < 0)
                    goto done;
            }
        }
    }
    ok = 0;
done:
    if (ok < 0)
        Py_CLEAR(*value);
    Py_XDECREF(parent);
    Py_XDECREF(key);
    Py_XDECREF(first);
    Py_XDECREF(children);
    Py_XDECREF(id);
    Py_XDECREF(plock);
    Py_XDECREF(pparent);
    Py_XDECREF(ns);
    return ok;
}

/* full_evict(tree, num_tokens, ctx) -> EvictResult: RadixTree.evict without a host tier (_evict_device_only): D-leaves
 * in policy order (stale heap entries skipped) until num_tokens are freed, one REMOVED record for them all (events on),
 * the sizes and the counter, the heap compacted past its bound, the freed slots end to end. ctx: (EvictResult,
 * default namespace, REMOVED, GPU, empty, int32 dtype, no slots, LRU key, heap slack, heap floor). */
static PyObject *full_evict(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyTuple_Check(args[2]) || PyTuple_GET_SIZE(args[2]) != 10) {
        PyErr_SetString(PyExc_TypeError, "full_evict(tree, num_tokens, ctx: (EvictResult, default_ns, REMOVED, GPU, "
                                         "empty, int32, no_slots, lru_key, heap_slack, heap_floor))");
        return NULL;
    }
    PyObject *tree = args[0], *ctx = args[2];
    int over;
    long long asked = PyLong_AsLongLongAndOverflow(args[1], &over);  /* a wire value may exceed 64 signed bits */
    Py_ssize_t want = over > 0 ? PY_SSIZE_T_MAX : over < 0 ? PY_SSIZE_T_MIN : (Py_ssize_t)asked, count = 0, total = 0;
    if (asked == -1 && !over && PyErr_Occurred())
        return NULL;
    PyObject *heap = tattr(tree, s_heap), *leaves = heap ? tattr(tree, s_leaves) : NULL,
             *nodes = leaves ? tattr(tree, s_nodes) : NULL, *ev = nodes ? tattr(tree, s_ev) : NULL,
             *pbo = ev ? tattr(tree, s_page_b) : NULL, *freed = NULL, *gone = NULL, *out = NULL,
             *indices = NULL, *counters = NULL;
    Py_ssize_t pb = pbo ? PyLong_AsSsize_t(pbo) : -1;
    if (pb == -1 || (freed = PyList_New(0)) == NULL || (ev != Py_None && (gone = PyList_New(0)) == NULL))
        goto done;
    if (!PyList_Check(heap) || !PySet_Check(leaves) || !PyDict_Check(nodes) || pb <= 0) {
        PyErr_SetString(PyExc_TypeError, "full_evict: the tree's heap, leaf set, node index or page are not as built");
        goto done;
    }
    int lazy = lazy_lru(tree, ctx);
    if (lazy < 0)
        goto done;
    while (count < want && PyList_GET_SIZE(heap) > 0) {
        PyObject *entry = PyObject_CallOneArg(heappop, heap);
        if (entry == NULL)
            goto done;
        if (!PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) != 4) {
            Py_DECREF(entry);
            PyErr_SetString(PyExc_TypeError, "full_evict: a heap entry must be (key, seq, version, node)");
            goto done;
        }
        PyObject *node = PyTuple_GET_ITEM(entry, 3), *dver = fget(node, FN_DVER), *value = NULL;
        int live = dver == NULL ? -1 : PyObject_RichCompareBool(PyTuple_GET_ITEM(entry, 2), dver, Py_EQ);
        Py_XDECREF(dver);
        if (live > 0)
            live = PySet_Contains(leaves, node);
        if (live > 0 && lazy) {  /* touched since it was pushed: back in at its place, not evicted */
            PyObject *key = PyTuple_GET_ITEM(entry, 0), *atime = fget(node, FN_ATIME);
            int same = atime == NULL ? -1 : PyObject_RichCompareBool(key, atime, Py_EQ);
            Py_XDECREF(atime);
            if (same == 0)
                live = heap_push(tree, node, 0, leaves, ctx) < 0 ? -1 : 0;
            else if (same < 0)
                live = -1;
        }
        if (live > 0 && evict_leaf(tree, node, leaves, nodes, gone, pb, ctx, &value) < 0)
            live = -1;
        Py_DECREF(entry);
        if (live < 0)
            goto done;
        if (value != NULL) {
            total += PyBytes_GET_SIZE(value);
            count += PyBytes_GET_SIZE(value) >> 2;
            int r = PyList_Append(freed, value);
            Py_DECREF(value);
            if (r < 0)
                goto done;
        }
    }
    if (gone != NULL && PyList_GET_SIZE(gone) > 0) {
        PyObject *rec = PyTuple_Pack(3, PyTuple_GET_ITEM(ctx, 2), gone, PyTuple_GET_ITEM(ctx, 3));
        PyObject *r = rec ? PyObject_CallMethodOneArg(ev, s_push_raw, rec) : NULL;
        Py_XDECREF(rec);
        if (r == NULL)
            goto done;
        Py_DECREF(r);
    }
    Py_ssize_t now, slack = PyLong_AsSsize_t(PyTuple_GET_ITEM(ctx, 8)), floor = PyLong_AsSsize_t(PyTuple_GET_ITEM(ctx, 9));
    if (PyErr_Occurred() || tree_add(tree, s_evictable, -count, NULL) < 0 ||
        (counters = tattr(tree, s_counters)) == NULL)
        goto done;
    layout_of(&ecounters_layout, Py_TYPE(counters));
    if (ladd(&ecounters_layout, counters, 0, count, &now) < 0)
        goto done;
    if (PyList_GET_SIZE(heap) > slack * PySet_GET_SIZE(leaves) + floor) {
        PyObject *r = PyObject_CallMethodObjArgs(tree, s_compact, heap, leaves, s_dver, NULL);
        if (r == NULL)
            goto done;
        Py_DECREF(r);
    }
    if (total == 0) {
        indices = Py_NewRef(PyTuple_GET_ITEM(ctx, 6));
    } else {
        Py_buffer w;
        if ((indices = new_vector(total / 4, 0, PyTuple_GET_ITEM(ctx, 4), PyTuple_GET_ITEM(ctx, 5))) == NULL ||
            PyObject_GetBuffer(indices, &w, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
            goto done;
        char *dst = w.buf;
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(freed); i++) {
            PyObject *v = PyList_GET_ITEM(freed, i);
            memcpy(dst, PyBytes_AS_STRING(v), (size_t)PyBytes_GET_SIZE(v));
            dst += PyBytes_GET_SIZE(v);
        }
        PyBuffer_Release(&w);
    }
    PyObject *res[5] = {indices, PyLong_FromSsize_t(count), PyTuple_New(0), PyLong_FromLong(0), PyTuple_New(0)};
    indices = NULL;
    out = make_result(&evict_layout, PyTuple_GET_ITEM(ctx, 0), res, 5);
done:
    Py_XDECREF(heap);
    Py_XDECREF(leaves);
    Py_XDECREF(nodes);
    Py_XDECREF(ev);
    Py_XDECREF(pbo);
    Py_XDECREF(freed);
    Py_XDECREF(gone);
    Py_XDECREF(indices);
    Py_XDECREF(counters);
    return out;
}

static const char *const match_names[] = {"indices", "matched_len", "host_hit_len", "node_id", "best_node_id"};
static Layout match_layout = {match_names, 5};

/* full_match(tree, root, key, page_bytes, ctx) -> MatchResult, or NotImplemented for a key to pack first.
 * RadixTree.match_prefix after finding the namespace's root (a tree without bigram keys): the walk (an edge the key
 * ends inside is split through tree._split), the counters, the path's access ticks, the refresh of the end nodes,
 * the device slots of the path end to end. ctx: (MatchResult, empty, int32 dtype, no slots, page tokens, LRU key,
 * heap slack, heap floor). */
static PyObject *full_match(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5 || !PyTuple_Check(args[4]) || PyTuple_GET_SIZE(args[4]) != 8) {
        PyErr_SetString(PyExc_TypeError, "full_match(tree, root, key, page_bytes, ctx: (result_type, empty, int32, "
                                         "no_slots, page, lru_key, heap_slack, heap_floor))");
        return NULL;
    }
    PyObject *tree = args[0], *root = args[1], *ctx = args[4];
    layout_of(&full_layout, Py_TYPE(root));
    Py_ssize_t pb = PyLong_AsSsize_t(args[3]), page = PyLong_AsSsize_t(PyTuple_GET_ITEM(ctx, 4));
    if (PyErr_Occurred())
        return NULL;
    if (pb <= 0 || pb % 4 || page <= 0 || pb != 4 * page) {
        PyErr_Format(PyExc_ValueError, "full_match: page of %zd bytes, %zd tokens", pb, page);
        return NULL;
    }
    Py_buffer key;
    int got = read_key(args[2], &key);
    if (got <= 0)
        return got < 0 ? NULL : Py_NewRef(Py_NotImplemented);
    const char *kb = key.buf;
    Py_ssize_t n = key.len - key.len % pb, off = 0, dev_off = 0, total = 0;
    Path path;
    path_init(&path);
    PyObject *out = NULL, *counters = NULL, *indices = NULL, *node = root, *dev = root;  /* borrowed */
    if ((counters = tattr(tree, s_counters)) == NULL || counter_add(counters, 0, key.len / 4) < 0)
        goto done;
    int stopped;
    if ((off = fdescend(tree, root, kb, n, pb, page, &path, 0, &stopped)) < 0)
        goto done;
    for (Py_ssize_t i = 0, at = 0; i < path.len; i++) {  /* ntok: key bytes walked, then the node's slot bytes */
        at += path.ntok[i];
        path.ntok[i] = 0;
        PyObject *v = fget(path.node[i], FN_VALUE);
        if (v == NULL)
            goto done;
        if (v != Py_None) {
            if (!PyBytes_Check(v)) {
                Py_DECREF(v);
                PyErr_SetString(PyExc_TypeError, "full_match: a node's value must be packed slots (bytes)");
                goto done;
            }
            path.ntok[i] = PyBytes_GET_SIZE(v);
            total += PyBytes_GET_SIZE(v);
            dev = path.node[i];
            dev_off = at;
        }
        Py_DECREF(v);
    }
    if (path.len)
        node = path.node[path.len - 1];
    if (counter_add(counters, 1, dev_off / 4) < 0 || counter_add(counters, 2, (off - dev_off) / 4) < 0)
        goto done;
    if (path.len) {  /* root to leaf: a child is always newer than its parent (R2.3) */
        PyObject *tv = tattr(tree, s_tick);
        Py_ssize_t tick = tv ? PyLong_AsSsize_t(tv) : -1;
        Py_XDECREF(tv);
        if (tick == -1 && PyErr_Occurred())
            goto done;
        for (Py_ssize_t i = 0; i < path.len; i++)
            if (fnode_set(path.node[i], FN_ATIME, PyLong_FromSsize_t(++tick)) < 0)
                goto done;
        tv = PyLong_FromSsize_t(tick);
        int r = tv == NULL ? -1 : tset(tree, s_tick, tv);
        Py_XDECREF(tv);
        int lazy = lazy_lru(tree, ctx);  /* RadixTree._lazy: the leaves' entries stay, eviction re-sorts them */
        if (r < 0 || lazy < 0 || (!lazy && (full_refresh(tree, node, ctx, 0) < 0 ||
                                            (dev != node && dev != root && full_refresh(tree, dev, ctx, 0) < 0))))
            goto done;
    }
    if (total == 0) {
        indices = Py_NewRef(PyTuple_GET_ITEM(ctx, 3));
    } else {
        indices = new_vector(total / 4, 0, PyTuple_GET_ITEM(ctx, 1), PyTuple_GET_ITEM(ctx, 2));
        Py_buffer w;
        if (indices == NULL || PyObject_GetBuffer(indices, &w, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
            goto done;
        int fits = w.len == total;
        char *dst = w.buf;
        for (Py_ssize_t i = 0; fits && i < path.len; i++) {
            if (path.ntok[i] == 0)
                continue;
            PyObject *v = fget(path.node[i], FN_VALUE);  /* the bytes measured above: nothing ran since but refresh */
            if (v == NULL || !PyBytes_Check(v) || PyBytes_GET_SIZE(v) != path.ntok[i]) {
                fits = 0;
            } else {
                memcpy(dst, PyBytes_AS_STRING(v), (size_t)path.ntok[i]);
                dst += path.ntok[i];
            }
            Py_XDECREF(v);
        }
        PyBuffer_Release(&w);
        if (!fits) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_RuntimeError, "full_match: the path's slots changed under the match");
            goto done;
        }
    }
    PyObject *res[5] = {indices, PyLong_FromSsize_t(dev_off / 4), PyLong_FromSsize_t((off - dev_off) / 4),
                        fget(dev, FN_ID), fget(node, FN_ID)};
    indices = NULL;
    out = make_result(&match_layout, PyTuple_GET_ITEM(ctx, 0), res, 5);
done:
    int64_release(&key);
    Py_XDECREF(counters);
    Py_XDECREF(indices);
    path_free(&path);
    return out;
}

static PyObject *node_template_usable(PyObject *Py_UNUSED(self), PyObject *cls) {
    if (!PyType_Check(cls)) {
        PyErr_SetString(PyExc_TypeError, "node_template_usable(cls): a class");
        return NULL;
    }
    NodeTemplate t;
    learn_node(&t, (PyTypeObject *)cls);
    for (int k = 0; k < t.n; k++)
        Py_XDECREF(t.value[k]);
    Py_DECREF(t.tp);
    return PyBool_FromLong(t.usable);
}

static PyObject *fast_paths(PyObject *Py_UNUSED(self), PyObject *Py_UNUSED(args)) {
    return Py_BuildValue("{sOsOsOsOsOsOsOsOsO}", "numpy_fields", np_type ? Py_True : Py_False, "numpy_new",
                         np_new ? Py_True : Py_False, "numpy_view", np_setbase ? Py_True : Py_False, "node_template",
                         node_tpl.usable ? Py_True : Py_False, "result_slots", result_layout.tp ? Py_True : Py_False,
                         "counter_slots", counters_layout.tp ? Py_True : Py_False, "match_slots",
                         match_layout.tp ? Py_True : Py_False, "node_slots", full_layout.tp ? Py_True : Py_False,
                         "hnode_slots", node_layout.tp ? Py_True : Py_False);
}

static PyMethodDef methods[] = {
    {"full_lock", (PyCFunction)(void (*)(void))full_lock, METH_FASTCALL,
     "RadixTree.lock's device walk: the tokens whose lock went 0 -> 1 (those nodes leave the D-leaf set)."},
    {"full_unlock", (PyCFunction)(void (*)(void))full_unlock, METH_FASTCALL,
     "RadixTree._dunlock's walk: (tokens whose lock went 1 -> 0, the root if its lock did, else None)."},
    {"full_match", (PyCFunction)(void (*)(void))full_match, METH_FASTCALL,
     "RadixTree.match_prefix after its root: walk, split, counters, ticks, refresh, the device slots."},
    {"full_descend", (PyCFunction)(void (*)(void))full_descend, METH_FASTCALL,
     "RadixTree.insert's descent: (path, the key's tail for a new leaf or None)."},
    {"full_evict", (PyCFunction)(void (*)(void))full_evict, METH_FASTCALL,
     "RadixTree.evict without a host tier: D-leaves in policy order until enough is freed; the freed slots."},
    {"lock_handle", (PyCFunction)(void (*)(void))lock_handle, METH_FASTCALL,
     "RadixTree.lock on a device-resident node (native trees bind it as tree.lock); anything else: the method."},
    {"unlock_handle", (PyCFunction)(void (*)(void))unlock_handle, METH_FASTCALL,
     "RadixTree.unlock of a device-anchored receipt (native trees bind it as tree.unlock); anything else: the method."},
    {"bind_locks", bind_locks, METH_O,
     "(lock, unlock): lock_handle and unlock_handle bound to one tree as builtin methods (a native tree's own)."},
    {"bind_insert", (PyCFunction)(void (*)(void))bind_insert, METH_FASTCALL,
     "RadixTree.insert bound to one native tree without a host tier: the common call in C, the rest the method's."},
    {"full_insert", (PyCFunction)(void (*)(void))full_insert, METH_FASTCALL,
     "RadixTree.insert without a host tier, after its checks: descent, walked nodes, duplicates, new leaf, result."},
    {"key_tokens", key_tokens, METH_O, "Tokens of a key read in place, or -1 for one to pack first."},
    {"node_template_usable", node_template_usable, METH_O,
     "Whether new leaves of this Node class could be built from a learned template (else its __init__ runs)."},
    {"fast_paths", fast_paths, METH_NOARGS,
     "Which fast paths this process proved: numpy's fields, constructor and views, the Node template, each known "
     "type's slots."},
    {"match", (PyCFunction)(void (*)(void))match, METH_FASTCALL, "HybridTree.match_prefix's walk and refresh."},
    {"lock_path", (PyCFunction)(void (*)(void))lock_path, METH_FASTCALL,
     "A FULL lock on node's path (delta 1) or its release (-1): the tokens whose lock went 0 -> 1 or 1 -> 0."},
    {"swa_acquire", (PyCFunction)(void (*)(void))swa_acquire, METH_FASTCALL,
     "SwaComponent.acquire's walk: (tokens of SWA nodes newly locked, the node where the window filled or None)."},
    {"swa_release", (PyCFunction)(void (*)(void))swa_release, METH_FASTCALL,
     "SwaComponent._unlock_walk's walk: the nodes whose window lock went to 0, in walk order."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_hwalk", "The radix trees' match and lock walks in C.", -1,
                                    methods};

PyMODINIT_FUNC PyInit__hwalk(void) {
    Layout *layouts[] = {&node_layout, &full_layout, &counters_layout, &result_layout, &match_layout, &insert_layout,
                         &icounters_layout, &evict_layout, &ecounters_layout};
    for (size_t i = 0; i < sizeof(layouts) / sizeof(layouts[0]); i++)
        for (int k = 0; k < layouts[i]->n; k++)
            if ((layouts[i]->names[k] = PyUnicode_InternFromString(layouts[i]->cnames[k])) == NULL)
                return NULL;
    struct { PyObject **at; const char *name; } names[] = {
        {&s_counters, "counters"}, {&s_clock, "_clock"}, {&s_tick, "_tick"}, {&s_leaves, "_leaves"},
        {&s_hleaves, "_hleaves"}, {&s_heap, "_heap"}, {&s_hheap, "_hheap"}, {&s_heap_seq, "_heap_seq"},
        {&s_key_of, "_key_of"}, {&s_compact, "_compact"}, {&s_dver, "dver"}, {&s_hver, "hver"}, {&s_handle, "_handle"},
        {&s_nodes, "_nodes"}, {&s_evictable, "evictable_size"}, {&s_ev, "_ev"},
        {&s_stored, "_stored"}, {&s_page_b, "_page_b"}, {&s_protected, "protected_size"}, {&s_receipts, "_receipts"},
        {&s_lock, "lock"}, {&s_unlock, "unlock"}, {&s_mctx, "_mctx"}, {&s_prune_root, "_prune_root"},
        {&s_roots, "_roots"}, {&s_span, "_span"}, {&s_push_raw, "push_raw"}, {&s_insert, "insert"},
        {&s_ictx, "_ictx"}, {&insert_kw[0], "namespace"}, {&insert_kw[1], "prev_prefix_len"},
        {&insert_kw[2], "priority"}, {&insert_kw[3], "chunked"}};
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
        if ((*names[i].at = PyUnicode_InternFromString(names[i].name)) == NULL)
            return NULL;
    if ((s_zero = PyLong_FromLong(0)) == NULL)
        return NULL;
    PyObject *hq = PyImport_ImportModule("_heapq");
    heappush = hq ? PyObject_GetAttrString(hq, "heappush") : NULL;
    heappop = hq ? PyObject_GetAttrString(hq, "heappop") : NULL;
    Py_XDECREF(hq);
    if (heappush == NULL || heappop == NULL)
        return NULL;
    return PyModule_Create(&module);
}
