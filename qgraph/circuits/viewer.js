// The attribution-graph viewer's behaviour (qgraph/circuits/viewer.py draws the page). Everything it reads
// comes from the SVG's data attributes; everything it writes is text (textContent), never HTML.
(function () {
  "use strict";
  var root = document.getElementById("__KEY__");
  if (!root || root.getAttribute("data-ready")) return;
  root.setAttribute("data-ready", "1");
  var TOP = 8;  // edges listed each way
  var svg = root.querySelector("svg.qg-graph"), SVG = svg.namespaceURI;
  var edgeLayer = svg.querySelector(".qg-edges"), nodeLayer = svg.querySelector(".qg-nodes");
  var $ = function (name) { return root.querySelector(name); };
  var detail = $(".qg-detail"), slider = $(".qg-threshold"), shown = $(".qg-threshold-value"),
      count = $(".qg-count"), search = $(".qg-search"), found = $(".qg-found"), groupName = $(".qg-group-name"),
      groupList = $(".qg-supernodes"), selectedText = $(".qg-selected");
  var largest = parseFloat(svg.getAttribute("data-largest")) || 1;
  var nodes = {}, order = [], base = [], edges = [], groups = [], made = 0;
  var state = {threshold: 0, pinned: null, hovered: null, selected: {}, owner: {}, styled: false};

  function attr(el, name) { return el.getAttribute("data-" + name); }
  function toggle(el, name, on) { el.classList.toggle(name, !!on); }
  function format(w) { return (w >= 0 ? "+" : "") + Number(w).toPrecision(4); }

  function addNode(el) {
    var n = {el: el, id: attr(el, "id"), kind: attr(el, "kind"), x: parseFloat(attr(el, "x")),
             y: parseFloat(attr(el, "y")), label: attr(el, "label"), info: attr(el, "info") || ""};
    nodes[n.id] = n;
    order.push(n);
    el.querySelectorAll("title").forEach(function (t) { t.remove(); });  // the panel shows it instead
    el.addEventListener("mouseenter", function () { hover(n.id); });
    el.addEventListener("mouseleave", function () { hover(null); });
    el.addEventListener("click", function (event) {
      event.stopPropagation();
      if (event.shiftKey || event.ctrlKey || event.metaKey) select(n);
      else pin(state.pinned === n.id ? null : n.id);
    });
    return n;
  }
  svg.querySelectorAll(".qg-node").forEach(addNode);
  svg.querySelectorAll(".qg-edge").forEach(function (el) {
    base.push({el: el, s: attr(el, "source"), t: attr(el, "target"), w: parseFloat(attr(el, "weight"))});
  });

  // -- grouping: a supernode stands for its members; its edges are the sums of theirs --------------------
  function path(a, b) {
    return "M" + a.x + "," + a.y + " Q" + ((a.x + b.x) / 2 + (a.y - b.y) * 0.08) + "," + (a.y + b.y) / 2 +
      " " + b.x + "," + b.y;
  }
  function drawEdge(e) {
    var share = Math.min(Math.abs(e.w) / largest, 1), el = document.createElementNS(SVG, "path");
    el.setAttribute("class", "qg-edge qg-super-edge");
    el.setAttribute("data-source", e.s); el.setAttribute("data-target", e.t); el.setAttribute("data-weight", e.w);
    el.setAttribute("d", path(nodes[e.s], nodes[e.t]));
    el.setAttribute("stroke", e.w >= 0 ? "#2166ac" : "#b2182b");
    el.setAttribute("stroke-width", (0.5 + 3.5 * share).toFixed(2));
    el.setAttribute("stroke-opacity", (0.25 + 0.65 * share).toFixed(2));
    edgeLayer.appendChild(el);
    e.el = el;
    return e;
  }
  function regroup() {
    edgeLayer.querySelectorAll(".qg-super-edge").forEach(function (el) { el.remove(); });
    var sums = {}, keys = [];
    edges = [];
    base.forEach(function (e) {
      var s = state.owner[e.s] || e.s, t = state.owner[e.t] || e.t;
      toggle(e.el, "qg-folded", s !== e.s || t !== e.t);
      if (s === e.s && t === e.t) { edges.push(e); return; }
      if (s === t) return;  // inside one supernode
      var key = s + "\u0000" + t;
      if (!(key in sums)) { sums[key] = {s: s, t: t, w: 0}; keys.push(key); }
      sums[key].w += e.w;
    });
    keys.forEach(function (key) { edges.push(drawEdge(sums[key])); });
  }
  function group() {
    var ids = Object.keys(state.selected);
    if (ids.length < 2) { selectedText.textContent = "select two or more features first (shift-click)"; return; }
    made += 1;
    var id = "supernode-" + made, name = groupName.value.trim() || "supernode " + made;
    var members = ids.map(function (m) { return nodes[m]; });
    var x = members.reduce(function (a, m) { return a + m.x; }, 0) / members.length;
    var y = members.reduce(function (a, m) { return a + m.y; }, 0) / members.length;
    var g = document.createElementNS(SVG, "g"), box = document.createElementNS(SVG, "rect"),
        text = document.createElementNS(SVG, "text"), width = Math.max(30, 6.2 * name.length + 14);
    g.setAttribute("class", "qg-node qg-supernode");
    [["id", id], ["kind", "supernode"], ["x", x], ["y", y], ["label", name], ["members", ids.join(",")],
     ["info", "supernode of " + ids.length + ": " + members.map(function (m) { return m.label; }).join(", ")]]
      .forEach(function (p) { g.setAttribute("data-" + p[0], p[1]); });
    box.setAttribute("class", "qg-glyph");
    [["x", x - width / 2], ["y", y - 9], ["width", width], ["height", 18], ["rx", 9], ["fill", "#e1bee7"]]
      .forEach(function (p) { box.setAttribute(p[0], p[1]); });
    text.setAttribute("class", "qg-label"); text.setAttribute("x", x); text.setAttribute("y", y + 4);
    text.setAttribute("text-anchor", "middle");
    text.textContent = name;
    g.appendChild(box); g.appendChild(text);
    nodeLayer.appendChild(g);
    addNode(g);
    ids.forEach(function (m) { state.owner[m] = id; });
    groups.push({id: id, name: name, members: ids});
    state.selected = {};
    groupName.value = "";
    var item = document.createElement("li"), undo = document.createElement("button");
    item.setAttribute("data-id", id);
    item.textContent = name + " (" + ids.length + ")";
    undo.type = "button"; undo.textContent = "ungroup";
    undo.addEventListener("click", function () { ungroup(id, item); });
    item.appendChild(undo);
    groupList.appendChild(item);
    regroup(); refresh();
  }
  function ungroup(id, item) {
    var found = groups.filter(function (g) { return g.id === id; })[0];
    found.members.forEach(function (m) { delete state.owner[m]; });
    groups = groups.filter(function (g) { return g.id !== id; });
    nodes[id].el.remove();
    order = order.filter(function (n) { return n.id !== id; });
    delete nodes[id];
    item.remove();
    if (state.pinned === id) state.pinned = null;
    if (state.hovered === id) state.hovered = null;
    regroup(); refresh();
  }
  function select(n) {
    if (n.kind !== "feature" && n.kind !== "error") return;
    if (state.selected[n.id]) delete state.selected[n.id]; else state.selected[n.id] = true;
    refresh();
  }

  // -- what is shown ---------------------------------------------------------------------------------------
  function pin(id) { state.pinned = id; refresh(); }
  function hover(id) {
    state.hovered = id;
    toggle(root, "qg-focus", id);
    edges.forEach(function (e) { toggle(e.el, "qg-on", id && (e.s === id || e.t === id)); });
    describe(id || state.pinned);
  }
  function refresh() {
    var pinned = state.pinned, on = {}, visible = 0, nodesShown = 0, strongest = 0;
    edges.forEach(function (e) {
      e.shown = Math.abs(e.w) >= state.threshold && (!pinned || e.s === pinned || e.t === pinned);
      toggle(e.el, "qg-hidden", !e.shown);
      if (e.shown) { visible += 1; on[e.s] = on[e.t] = true; strongest = Math.max(strongest, Math.abs(e.w)); }
    });
    if (pinned || state.styled) edges.forEach(function (e) {  // a pinned node's edges: by their share of its strongest
      var share = pinned && e.shown ? Math.abs(e.w) / (strongest || 1) : null;
      e.el.style.strokeWidth = share === null ? "" : (1 + 4 * share).toFixed(2);
      e.el.style.strokeOpacity = share === null ? "" : (0.45 + 0.55 * share).toFixed(2);
    });
    state.styled = !!pinned;
    base.forEach(function (e) { if (e.el.classList.contains("qg-folded")) toggle(e.el, "qg-hidden", true); });
    order.forEach(function (n) {
      var hidden = !!state.owner[n.id] || (pinned && !on[n.id] && n.id !== pinned);
      toggle(n.el, "qg-hidden", hidden);
      toggle(n.el, "qg-faint", !pinned && !on[n.id] && n.kind !== "embedding" && n.kind !== "logit");
      toggle(n.el, "qg-pinned", n.id === pinned);
      toggle(n.el, "qg-selected", state.selected[n.id]);
      if (!hidden) nodesShown += 1;
    });
    toggle(root, "qg-pinning", pinned);
    root.setAttribute("data-pinned", pinned || "");
    count.textContent = visible + " of " + edges.length + " edges, " + nodesShown + " nodes shown" +
      (pinned ? " (pinned: " + nodes[pinned].label + ")" : "");
    var chosen = Object.keys(state.selected).length;
    selectedText.textContent = chosen ? chosen + " selected: name them and press group" :
      "shift-click features to select them";
    describe(state.hovered || pinned);
  }
  function table(title, rows, end) {
    var t = document.createElement("table"), caption = document.createElement("caption");
    caption.textContent = title;
    t.appendChild(caption);
    t.setAttribute("class", "qg-" + end);
    rows.forEach(function (e) {
      var tr = document.createElement("tr"), name = document.createElement("td"), w = document.createElement("td");
      var other = nodes[end === "inputs" ? e.s : e.t];
      tr.setAttribute("class", "qg-row" + (Math.abs(e.w) < state.threshold ? " qg-under" : ""));
      tr.setAttribute("data-source", e.s); tr.setAttribute("data-target", e.t);
      tr.setAttribute("data-weight", e.w);
      name.textContent = other ? other.label : (end === "inputs" ? e.s : e.t);
      w.textContent = format(e.w);
      w.setAttribute("class", "qg-w " + (e.w >= 0 ? "qg-pos" : "qg-neg"));
      tr.appendChild(name); tr.appendChild(w);
      t.appendChild(tr);
    });
    return t;
  }
  function describe(id) {
    while (detail.firstChild) detail.removeChild(detail.firstChild);
    root.setAttribute("data-shown", id || "");
    if (!id || !nodes[id]) {
      detail.textContent = "Hover a node for its activation and its strongest edges; click it to pin it.";
      return;
    }
    var n = nodes[id], head = document.createElement("div"), facts = document.createElement("div");
    head.setAttribute("class", "qg-detail-title"); head.textContent = n.label;
    facts.setAttribute("class", "qg-detail-facts"); facts.textContent = n.info;
    detail.appendChild(head); detail.appendChild(facts);
    var strongest = function (a, b) { return Math.abs(b.w) - Math.abs(a.w); };
    var ins = edges.filter(function (e) { return e.t === id; }).sort(strongest);
    var outs = edges.filter(function (e) { return e.s === id; }).sort(strongest);
    if (ins.length) detail.appendChild(table("top inputs (" + Math.min(TOP, ins.length) + " of " + ins.length + ")",
                                             ins.slice(0, TOP), "inputs"));
    if (outs.length) detail.appendChild(table("top outputs (" + Math.min(TOP, outs.length) + " of " + outs.length +
                                              ")", outs.slice(0, TOP), "outputs"));
  }

  // -- the controls ----------------------------------------------------------------------------------------
  slider.addEventListener("input", function () {
    var share = slider.value / slider.max;
    state.threshold = largest * share * share;  // finer steps among the small weights
    slider.setAttribute("data-threshold", state.threshold);
    shown.textContent = state.threshold.toPrecision(3);
    refresh();
  });
  function matches(n, terms) {
    var text = (n.label + "\n" + n.info).toLowerCase();
    return terms.every(function (term) {
      var m = /^l(\d+)$/i.exec(term);
      if (m) return attr(n.el, "layer") === m[1] && n.kind !== "logit";
      m = /^(?:f|#)?(\d+)$/i.exec(term);
      if (m) return n.kind === "feature" && attr(n.el, "feature") === m[1];
      return text.indexOf(term.toLowerCase()) >= 0;
    });
  }
  search.addEventListener("input", function () {
    var terms = search.value.trim().split(/[\s,]+/).filter(Boolean), hits = 0;
    order.forEach(function (n) {
      var hit = terms.length > 0 && matches(n, terms);
      toggle(n.el, "qg-match", hit);
      if (hit) hits += 1;
    });
    toggle(root, "qg-searching", terms.length);
    found.textContent = terms.length ? hits + " found" + (hits ? " (Enter pins the first)" : "") : "";
  });
  search.addEventListener("keydown", function (event) {
    var first = svg.querySelector(".qg-node.qg-match:not(.qg-hidden)");
    if (event.key === "Enter" && first) pin(attr(first, "id"));
  });
  $(".qg-group").addEventListener("click", group);
  svg.addEventListener("click", function () { pin(null); });
  document.addEventListener("keydown", function (event) {
    if (event.key !== "Escape") return;
    if (state.pinned) pin(null); else { state.selected = {}; refresh(); }
  });
  regroup();
  refresh();
})();
