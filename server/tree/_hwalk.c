/* HybridTree.match_prefix (server/tree/hybrid.py) between packing the key and building the result, in C: the same
 * steps in the same order on the same Python objects (HNode slots, the components' LRU dicts), without the
 * interpreter's per-node overhead.
 *
 * match(tree, root, kb, page_bytes, rules) -> (indices, best, best_n, hit_tokens)
 *     kb: packed int32 tokens (bytes, or a C-contiguous int32 array: no copy), its whole pages only.
 *     The walk along whole edges of kb (children keyed by their first page); an edge the key ends
 *     inside is split through tree._split; then the deepest node every component accepts as a match end (each
 *     component's rule, in registration order, until none moves it), each component's LRU refresh there, the
 *     tree's clock tick (tree._clock) and the access times of the path (a parent just older than its child).
 *     indices: None (nothing matched), best.full (one node) or a bytearray of the path's int64 FULL slots.
 * lock_path(node, delta) -> int
 *     HybridTree.lock's and unlock's FULL walk: every node from node up to (not including) its root takes delta
 *     (1 or -1) on its lock count; returns the tokens of the nodes whose count went 0 -> 1 (or 1 -> 0).
 * swa_acquire(node, window) -> (tokens, boundary), swa_release(node, uuid) -> [nodes]
 *     SwaComponent's window lock walks (components/swa.py): the counting and the slock updates; the component
 *     does the rest (counters, the boundary's mark, leaf updates and drops, in walk order).
 * A rule: ("swa", window, budget, prev, next, head) or ("mamba", prev, next, head); prev/next are the component's
 * Lru dicts (server/tree/components/base.py).
 * HybridTree._match_path is the Python reference (no C compiler at install, or native=False); a property test
 * runs both on the same operations and holds every result and every node equal.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>
#include <structmember.h>

static PyObject *s_children, *s_key, *s_parent, *s_atime, *s_swa, *s_n, *s_mamba, *s_full, *s_lock, *s_slock, *s_suuid,
    *s_clock;

/* HNode's __slots__ are read and written at their offsets (what their member descriptors do, without the
 * attribute lookup); any other object, or a slot left unset, goes through the generic attribute protocol. */
enum { K_CHILDREN, K_KEY, K_PARENT, K_ATIME, K_SWA, K_N, K_MAMBA, K_FULL, K_LOCK, K_SLOCK, K_SUUID, K_SLOTS };
static PyObject **slot_names[K_SLOTS] = {&s_children, &s_key, &s_parent, &s_atime, &s_swa, &s_n, &s_mamba, &s_full,
                                         &s_lock, &s_slock, &s_suuid};
static PyTypeObject *node_type;
static Py_ssize_t slot_at[K_SLOTS];

static void learn_slots(PyTypeObject *tp) {
    if (node_type != NULL || !(tp->tp_flags & Py_TPFLAGS_HEAPTYPE) || tp->tp_dict == NULL)
        return;
    for (int k = 0; k < K_SLOTS; k++) {
        PyObject *d = PyDict_GetItemWithError(tp->tp_dict, *slot_names[k]);
        if (d == NULL || Py_TYPE(d) != &PyMemberDescr_Type ||
            ((PyMemberDescrObject *)d)->d_member->type != T_OBJECT_EX) {
            PyErr_Clear();
            return;
        }
        slot_at[k] = ((PyMemberDescrObject *)d)->d_member->offset;
    }
    Py_INCREF(tp);
    node_type = tp;
}

static inline PyObject *nget(PyObject *obj, int k) {  /* a new reference */
    if (Py_TYPE(obj) == node_type) {
        PyObject *v = *(PyObject **)((char *)obj + slot_at[k]);
        if (v != NULL) {
            Py_INCREF(v);
            return v;
        }
    }
    return PyObject_GetAttr(obj, *slot_names[k]);
}

static inline int nset(PyObject *obj, int k, PyObject *v) {
    if (Py_TYPE(obj) == node_type) {
        PyObject **at = (PyObject **)((char *)obj + slot_at[k]), *old = *at;
        Py_INCREF(v);
        *at = v;
        Py_XDECREF(old);
        return 0;
    }
    return PyObject_SetAttr(obj, *slot_names[k], v);
}

/* The walk of match(): (path, hit_tokens, partial, common_tokens) for the whole pages of kb[:len]. */
static PyObject *walk(PyObject *root, const char *kb, Py_ssize_t len, Py_ssize_t pb) {
    len -= len % pb;
    PyObject *path = PyList_New(0);
    if (path == NULL)
        return NULL;
    PyObject *node = root;
    Py_INCREF(node);
    PyObject *partial = NULL;
    Py_ssize_t off = 0, common = 0;
    while (off + pb <= len) {
        PyObject *children = nget(node, K_CHILDREN);
        if (children == NULL)
            goto fail;
        if (!PyDict_Check(children)) {
            Py_DECREF(children);
            PyErr_SetString(PyExc_TypeError, "walk: children must be a dict");
            goto fail;
        }
        PyObject *page = PyBytes_FromStringAndSize(kb + off, pb);
        if (page == NULL) {
            Py_DECREF(children);
            goto fail;
        }
        PyObject *child = PyDict_GetItemWithError(children, page);
        Py_DECREF(page);
        Py_XINCREF(child);
        Py_DECREF(children);
        if (child == NULL) {
            if (PyErr_Occurred())
                goto fail;
            break;
        }
        PyObject *ck = nget(child, K_KEY);
        if (ck == NULL || !PyBytes_Check(ck)) {
            Py_XDECREF(ck);
            Py_DECREF(child);
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_TypeError, "walk: a node's key must be bytes");
            goto fail;
        }
        Py_ssize_t cl = PyBytes_GET_SIZE(ck);
        const char *a = PyBytes_AS_STRING(ck), *b = kb + off;
        if (cl <= len - off && memcmp(a, b, (size_t)cl) == 0) {
            Py_DECREF(ck);
            if (PyList_Append(path, child) < 0) {
                Py_DECREF(child);
                goto fail;
            }
            off += cl;
            Py_DECREF(node);
            node = child;
            continue;
        }
        Py_ssize_t ntok = (cl < len - off ? cl : len - off) / 4, i = 0;
        while (i < ntok && memcmp(a + 4 * i, b + 4 * i, 4) == 0)
            i++;
        Py_DECREF(ck);
        common = i - i % (pb / 4);
        partial = child;
        break;
    }
    Py_DECREF(node);
    if (partial == NULL) {
        partial = Py_None;
        Py_INCREF(partial);
    }
    return Py_BuildValue("(NnNn)", path, off / 4, partial, common);
fail:
    Py_DECREF(node);
    Py_DECREF(path);
    return NULL;
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

static Py_ssize_t swa_deepest_impl(PyObject *path, Py_ssize_t limit, Py_ssize_t window) {
    int unbounded = 1;  /* no gap since the root: any node may end a match */
    Py_ssize_t covered = 0, best = 0;
    for (Py_ssize_t i = 0; i < limit; i++) {
        PyObject *node = PyList_GET_ITEM(path, i);
        int has = attr_true(node, K_SWA);
        if (has < 0)
            return -1;
        if (!has) {
            unbounded = 0;
            covered = 0;
            continue;
        }
        Py_ssize_t n;
        if (attr_ssize(node, K_N, &n) < 0)
            return -1;
        covered += n;
        if (unbounded || covered >= window)
            best = i + 1;
    }
    return best;
}

static Py_ssize_t mamba_deepest_impl(PyObject *path, Py_ssize_t limit) {
    for (Py_ssize_t i = limit - 1; i >= 0; i--) {
        Py_ssize_t slot;
        if (attr_ssize(PyList_GET_ITEM(path, i), K_MAMBA, &slot) < 0)
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

/* prev/next: dicts of the doubly linked list; every lookup must hit (a miss is a broken list: KeyError). */
static PyObject *get(PyObject *d, PyObject *k) {
    PyObject *v = PyDict_GetItemWithError(d, k);
    if (v == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetObject(PyExc_KeyError, k);
        return NULL;
    }
    Py_INCREF(v);
    return v;
}

static PyObject *pop(PyObject *d, PyObject *k) {
    PyObject *v = get(d, k);
    if (v != NULL && PyDict_DelItem(d, k) < 0) {
        Py_DECREF(v);
        return NULL;
    }
    return v;
}

static int move_after(PyObject *prev, PyObject *next, PyObject *after, PyObject *node) {
    /* remove(node) then _link_after(after, node), as Lru does them */
    PyObject *p = pop(prev, node);
    if (p == NULL)
        return -1;
    PyObject *n = pop(next, node);
    if (n == NULL) {
        Py_DECREF(p);
        return -1;
    }
    int r = PyDict_SetItem(next, p, n) < 0 || PyDict_SetItem(prev, n, p) < 0 ? -1 : 0;
    Py_DECREF(p);
    Py_DECREF(n);
    if (r < 0)
        return -1;
    n = get(next, after);
    if (n == NULL)
        return -1;
    r = (PyDict_SetItem(prev, node, after) < 0 || PyDict_SetItem(next, node, n) < 0 ||
         PyDict_SetItem(next, after, node) < 0 || PyDict_SetItem(prev, n, node) < 0) ? -1 : 0;
    Py_DECREF(n);
    return r;
}

static int lru_path_impl(PyObject *prev, PyObject *next, PyObject *after, PyObject *node, double budget, int attr) {
    Py_INCREF(after);
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
        if (has < 0) {
            Py_DECREF(parent);
            goto fail;
        }
        if (has) {
            PyObject *p = PyDict_GetItemWithError(prev, node);
            if (p == NULL) {
                if (!PyErr_Occurred())
                    PyErr_SetObject(PyExc_KeyError, node);
                Py_DECREF(parent);
                goto fail;
            }
            if (p != after && move_after(prev, next, after, node) < 0) {
                Py_DECREF(parent);
                goto fail;
            }
            Py_DECREF(after);
            after = node;
            Py_INCREF(after);
        }
        Py_ssize_t n;
        if (attr_ssize(node, K_N, &n) < 0) {
            Py_DECREF(parent);
            goto fail;
        }
        used += (double)n;
        Py_DECREF(node);
        node = parent;
    }
    Py_DECREF(after);
    Py_DECREF(node);
    return 0;
fail:
    Py_DECREF(after);
    Py_DECREF(node);
    return -1;
}

static PyObject *concat_impl(PyObject *path, Py_ssize_t limit) {
    Py_buffer views[64], *v = views;
    if (limit > 64 && (v = PyMem_Malloc(sizeof(Py_buffer) * (size_t)limit)) == NULL)
        return PyErr_NoMemory();
    Py_ssize_t got = 0, total = 0;
    PyObject *out = NULL;
    for (; got < limit; got++) {
        PyObject *full = nget(PyList_GET_ITEM(path, got), K_FULL);
        if (full == NULL)
            goto done;
        int r = PyObject_GetBuffer(full, &v[got], PyBUF_C_CONTIGUOUS);  /* itemsize is set without the format */
        Py_DECREF(full);
        if (r < 0)
            goto done;
        if (v[got].itemsize != 8) {
            PyErr_SetString(PyExc_TypeError, "concat: slot arrays must be int64");
            PyBuffer_Release(&v[got]);
            goto done;
        }
        total += v[got].len;
    }
    out = PyByteArray_FromStringAndSize(NULL, total);
    if (out != NULL) {
        char *dst = PyByteArray_AS_STRING(out);
        for (Py_ssize_t i = 0; i < limit; i++) {
            memcpy(dst, v[i].buf, (size_t)v[i].len);
            dst += v[i].len;
        }
    }
done:
    for (Py_ssize_t i = 0; i < got; i++)
        PyBuffer_Release(&v[i]);
    if (v != views)
        PyMem_Free(v);
    return out;
}

/* One rule per auxiliary component, in registration order: ("swa", window, budget, prev, next, head) or
 * ("mamba", prev, next, head) (the component's match end, then its LRU refresh at the match end). */
static PyObject *match(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5 || !PyTuple_Check(args[4])) {
        PyErr_SetString(PyExc_TypeError, "match(tree, root, kb, page_bytes, rules: tuple)");
        return NULL;
    }
    PyObject *tree = args[0], *root = args[1], *rules = args[4];
    learn_slots(Py_TYPE(root));
    Py_ssize_t nrules = PyTuple_GET_SIZE(rules);
    for (Py_ssize_t r = 0; r < nrules; r++) {
        PyObject *rule = PyTuple_GET_ITEM(rules, r);
        Py_ssize_t size = PyTuple_Check(rule) ? PyTuple_GET_SIZE(rule) : 0;  /* 6: SWA, 4: MAMBA */
        if ((size != 6 && size != 4) || !PyDict_Check(PyTuple_GET_ITEM(rule, size - 3)) ||
            !PyDict_Check(PyTuple_GET_ITEM(rule, size - 2))) {
            PyErr_SetString(PyExc_TypeError, "match: a rule is ('swa', window, budget, prev, next, head) or "
                                             "('mamba', prev, next, head)");
            return NULL;
        }
    }
    Py_ssize_t pb = PyLong_AsSsize_t(args[3]);
    if (pb == -1 && PyErr_Occurred())
        return NULL;
    if (pb <= 0 || pb % 4) {
        PyErr_Format(PyExc_ValueError, "match: page of %zd bytes", pb);
        return NULL;
    }
    Py_buffer key;  /* packed little-endian int32 tokens: bytes, or a C-contiguous int32 array */
    if (PyObject_GetBuffer(args[2], &key, PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    if (key.itemsize != 4 && key.itemsize != 1) {
        PyBuffer_Release(&key);
        PyErr_SetString(PyExc_TypeError, "match: the key is packed int32 tokens");
        return NULL;
    }
    PyObject *w = walk(root, key.buf, key.len, pb);
    PyBuffer_Release(&key);
    if (w == NULL)
        return NULL;
    PyObject *path = PyTuple_GET_ITEM(w, 0), *partial = PyTuple_GET_ITEM(w, 2), *out = NULL, *indices = NULL;
    Py_INCREF(path);
    Py_ssize_t hit = PyLong_AsSsize_t(PyTuple_GET_ITEM(w, 1)), common = PyLong_AsSsize_t(PyTuple_GET_ITEM(w, 3));
    if (partial != Py_None) {
        hit += common;
        PyObject *ck = nget(partial, K_KEY);
        if (ck == NULL)
            goto done;
        Py_ssize_t cl = PyBytes_Check(ck) ? PyBytes_GET_SIZE(ck) : -1;
        Py_DECREF(ck);
        PyObject *end = partial;
        Py_INCREF(end);
        if (common * 4 < cl) {
            Py_DECREF(end);
            end = PyObject_CallMethod(tree, "_split", "On", partial, common);
            if (end == NULL)
                goto done;
        }
        int r = PyList_Append(path, end);
        Py_DECREF(end);
        if (r < 0)
            goto done;
    }
    Py_ssize_t best_n = PyList_GET_SIZE(path);
    int settled = 0;
    while (!settled && best_n) {  /* the deepest node every component accepts as a match end */
        settled = 1;
        for (Py_ssize_t r = 0; r < nrules; r++) {
            PyObject *rule = PyTuple_GET_ITEM(rules, r);
            Py_ssize_t n;
            if (PyTuple_GET_SIZE(rule) == 6) {
                Py_ssize_t window = PyLong_AsSsize_t(PyTuple_GET_ITEM(rule, 1));
                if (window == -1 && PyErr_Occurred())
                    goto done;
                n = swa_deepest_impl(path, best_n, window);
            } else {
                n = mamba_deepest_impl(path, best_n);
            }
            if (n < 0)
                goto done;
            if (n != best_n) {
                best_n = n;
                settled = 0;
            }
        }
    }
    PyObject *best = best_n ? PyList_GET_ITEM(path, best_n - 1) : root;
    for (Py_ssize_t r = 0; r < nrules; r++) {
        PyObject *rule = PyTuple_GET_ITEM(rules, r);
        if (PyTuple_GET_SIZE(rule) == 6) {
            double budget = PyFloat_AsDouble(PyTuple_GET_ITEM(rule, 2));
            if ((budget == -1.0 && PyErr_Occurred()) ||
                lru_path_impl(PyTuple_GET_ITEM(rule, 3), PyTuple_GET_ITEM(rule, 4), PyTuple_GET_ITEM(rule, 5), best,
                              budget, K_SWA) < 0)
                goto done;
        } else {
            Py_ssize_t slot;
            if (attr_ssize(best, K_MAMBA, &slot) < 0)
                goto done;
            if (slot >= 0 && move_after(PyTuple_GET_ITEM(rule, 1), PyTuple_GET_ITEM(rule, 2),
                                        PyTuple_GET_ITEM(rule, 3), best) < 0)
                goto done;
        }
    }
    PyObject *clock = PyObject_GetAttr(tree, s_clock);  /* the tree's _clock_tick() */
    if (clock == NULL)
        goto done;
    double t = PyFloat_AsDouble(clock);
    Py_DECREF(clock);
    if (t == -1.0 && PyErr_Occurred())
        goto done;
    clock = PyFloat_FromDouble(t + 1.0);
    if (clock == NULL || PyObject_SetAttr(tree, s_clock, clock) < 0) {
        Py_XDECREF(clock);
        goto done;
    }
    Py_DECREF(clock);
    if (touch_impl(best, t, 1e-5) < 0)
        goto done;
    if (best_n == 0) {
        indices = Py_None;
        Py_INCREF(indices);
    } else if (best_n == 1) {
        indices = nget(best, K_FULL);
    } else {
        indices = concat_impl(path, best_n);
    }
    if (indices != NULL && (out = PyTuple_New(4)) != NULL) {
        PyObject *n = PyLong_FromSsize_t(best_n), *h = PyLong_FromSsize_t(hit);
        Py_INCREF(best);
        PyTuple_SET_ITEM(out, 0, indices);
        PyTuple_SET_ITEM(out, 1, best);
        PyTuple_SET_ITEM(out, 2, n);
        PyTuple_SET_ITEM(out, 3, h);
        indices = NULL;
        if (n == NULL || h == NULL)
            Py_CLEAR(out);
    }
    Py_XDECREF(indices);
done:
    Py_DECREF(path);
    Py_DECREF(w);
    return out;
}

static int add_to(PyObject *node, int k, Py_ssize_t delta, Py_ssize_t *was) {
    PyObject *v = NULL;
    if (attr_ssize(node, k, was) < 0 || (v = PyLong_FromSsize_t(*was + delta)) == NULL || nset(node, k, v) < 0) {
        Py_XDECREF(v);
        return -1;
    }
    Py_DECREF(v);
    return 0;
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

static PyMethodDef methods[] = {
    {"match", (PyCFunction)(void (*)(void))match, METH_FASTCALL, "HybridTree.match_prefix's walk and refresh."},
    {"lock_path", (PyCFunction)(void (*)(void))lock_path, METH_FASTCALL,
     "A FULL lock on node's path (delta 1) or its release (-1): the tokens whose lock went 0 -> 1 or 1 -> 0."},
    {"swa_acquire", (PyCFunction)(void (*)(void))swa_acquire, METH_FASTCALL,
     "SwaComponent.acquire's walk: (tokens of SWA nodes newly locked, the node where the window filled or None)."},
    {"swa_release", (PyCFunction)(void (*)(void))swa_release, METH_FASTCALL,
     "SwaComponent._unlock_walk's walk: the nodes whose window lock went to 0, in walk order."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_hwalk", "The hybrid tree's match loops in C.", -1,
                                    methods};

PyMODINIT_FUNC PyInit__hwalk(void) {
    const char *names[] = {"children", "key", "parent", "atime", "swa", "n", "mamba", "full", "lock", "slock", "suuid",
                           "_clock"};
    PyObject **slots[] = {&s_children, &s_key, &s_parent, &s_atime, &s_swa, &s_n, &s_mamba, &s_full, &s_lock,
                          &s_slock, &s_suuid, &s_clock};  /* interned */
    for (int i = 0; i < 12; i++) {
        *slots[i] = PyUnicode_InternFromString(names[i]);
        if (*slots[i] == NULL)
            return NULL;
    }
    return PyModule_Create(&module);
}
