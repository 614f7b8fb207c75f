// The demo page: sends the sentence to POST /translate and draws what comes back with Plotly.
"use strict";

const ATTENTION_NAMES = {
  enc_self: "encoder self-attention",
  dec_self: "decoder self-attention",
  enc_dec: "encoder-decoder attention",
};
const $ = (id) => document.getElementById(id);
let result = null;

// Plotly reads tick texts as its subset of HTML: "</s>" would be an (empty) closing tag.
const plotlyText = (token) => token.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;");

// Colour scales from white (0) to a dark hue (the largest value). Plotly's named "Blues" and
// "Greens" run the other way (dark at 0), and a name Plotly does not know falls back silently.
const SCALES = {
  attention: [[0, "#f7fbff"], [0.35, "#9ecae1"], [0.7, "#3182bd"], [1, "#08306b"]],
  competition: [[0, "#fff5eb"], [0.35, "#fdae6b"], [0.7, "#e6550d"], [1, "#7f2704"]],
  activation: [[0, "#f7fcf5"], [0.35, "#a1d99b"], [0.7, "#31a354"], [1, "#00441b"]],
};

// Token labels as tick texts on numeric axes: a categorical axis would merge repeated tokens.
// Without column tokens the columns are numbered from 1 (clusters, mechanisms, RIMs).
function heatmap(element, z, rowTokens, columnTokens, title, options = {}) {
  const rows = rowTokens.map((_, i) => i);
  const columns = columnTokens ? columnTokens.map((_, i) => i) : z[0].map((_, i) => i + 1);
  const trace = {
    type: "heatmap", z, colorscale: options.colorscale || SCALES.attention, zmin: 0,
    zmax: options.zmax ?? (z.flat().reduce((a, b) => Math.max(a, b), 0) || 1),
    x: columns, y: rows,
    // the hover names the tokens ("%{y}" would be the row number)
    text: rowTokens.map((r) => columns.map((c) => columnTokens
      ? `${plotlyText(r)} → ${plotlyText(columnTokens[c])}` : `${plotlyText(r)}, ${options.xTitle} ${c}`)),
    hovertemplate: "%{text}: %{z:.3f}<extra></extra>",
  };
  const height = Math.max(320, 80 + 18 * rowTokens.length);
  const layout = {
    // the title sits just above the plot area, below the mode bar that Plotly draws in the top margin
    title: { text: title, font: { size: 14 }, yref: "paper", y: 1, yanchor: "bottom", pad: { b: 8 } },
    height: height + 30, margin: { l: 110, r: 20, t: 70, b: 110 },
    yaxis: { tickvals: rows, ticktext: rowTokens.map(plotlyText), autorange: "reversed", automargin: true },
    xaxis: columnTokens
      ? { tickvals: columns, ticktext: columnTokens.map(plotlyText), tickangle: -60, automargin: true }
      : { title: { text: options.xTitle || "" }, dtick: 1, automargin: true },  // a bare string: dropped since plotly.js 3
  };
  Plotly.react(element, [trace], layout, { responsive: true, displaylogo: false });
}

function fillSelect(select, labels, keep = true) {
  const previous = select.value;
  select.replaceChildren(...labels.map((label, i) => new Option(label, String(i))));
  if (keep && previous !== "" && Number(previous) < labels.length) select.value = previous;
}

function range(n, prefix) {
  return Array.from({ length: n }, (_, i) => `${prefix} ${i + 1}`);
}

// The labels of the views' rows and columns: the tokens, or for a long text whose views the
// server pooled over blocks of tokens (view_pooling > 1, to keep its answer under
// --max-response-bytes), each block's "first…last".
function viewTokens(side) {
  return result.view_tokens[side];
}

// Query (row) and key (column) tokens of an attention type.
function axes(kind) {
  const src = viewTokens("source");
  const tgt = viewTokens("target");
  if (kind === "enc_self") return [src, src];
  if (kind === "dec_self") return [tgt, viewTokens("decoder_input")];
  return [tgt, src];
}

function drawAttention() {
  const kind = $("attention-type").value;
  const layers = result.attention[kind];
  fillSelect($("attention-layer"), result.attention_layers[kind]);
  const layer = layers[Number($("attention-layer").value)];
  fillSelect($("attention-head"), range(layer.length, "head"));
  const head = Number($("attention-head").value);
  const [rows, columns] = axes(kind);
  const title = `${result.attention_layers[kind][Number($("attention-layer").value)]}, head ${head + 1}`;
  heatmap($("attention-heatmap"), layer[head], rows, columns, title);
}

function drawDma() {
  const kind = $("dma-type").value;
  const layers = result.dma[kind];
  fillSelect($("dma-layer"), layers.map((l) => l.layer));
  const layer = layers[Number($("dma-layer").value)];
  fillSelect($("dma-head"), range(layer.query_posteriors.length, "head"));
  const head = Number($("dma-head").value);
  const [rows, columns] = axes(kind);
  $("dma-gamma").textContent = `mask weight at inference γ = ${layer.gamma.toFixed(3)}`;
  // the query tokens' posteriors P^q are the rows of M, the key tokens' P^k its columns
  const keys = $("dma-side").value === "keys";
  heatmap($("dma-clusters"), keys ? layer.key_posteriors[head] : layer.query_posteriors[head], keys ? columns : rows,
          null, `cluster probabilities of the ${keys ? "keys" : "queries"}, head ${head + 1}`,
          { colorscale: "Viridis", zmax: 1, xTitle: "cluster" });
  heatmap($("dma-mask"), layer.mask[head], rows, columns, `semantic mask M, ${layer.layer}, head ${head + 1}`,
          { colorscale: "Viridis", zmax: 1 });
}

function drawTim() {
  const layer = result.tim[Number($("tim-layer").value)];
  const rows = viewTokens(layer.side === "encoder" ? "source" : "target");
  heatmap($("tim-heatmap"), layer.competition, rows, null, `competition, ${layer.layer}`,
          { colorscale: SCALES.competition, zmax: 1, xTitle: "mechanism" });
}

function drawRim() {
  const layer = result.rim[Number($("rim-layer").value)];
  heatmap($("rim-heatmap"), layer.activation, viewTokens("source"), null, `activation, ${layer.layer}`,
          { colorscale: SCALES.activation, zmax: 1, xTitle: "RIM" });
}

function show(data) {
  result = data;
  $("output").hidden = false;
  $("translation").textContent = data.translation;
  const notes = [`${data.source_tokens.length} source and ${data.target_tokens.length} target tokens`,
                 `score ${data.score.toFixed(3)}`, `${data.milliseconds} ms`];
  if (data.view_pooling > 1) notes.push(`views averaged over blocks of ${data.view_pooling} tokens (a long text)`);
  if (data.unknown_tokens.length) notes.unshift(`unknown to the model (read as <unk>): ${data.unknown_tokens.join(" ")}`);
  $("details").textContent = notes.join(" · ");

  const kinds = Object.keys(data.attention);
  $("attention-view").hidden = kinds.length === 0;
  if (kinds.length) {
    const type = $("attention-type");
    const previous = type.value;
    type.replaceChildren(...kinds.map((k) => new Option(ATTENTION_NAMES[k] || k, k)));
    if (kinds.includes(previous)) type.value = previous;
    drawAttention();
  }
  $("dma-view").hidden = !data.dma;
  if (data.dma) {
    const type = $("dma-type");
    const previous = type.value;
    const dmaKinds = Object.keys(data.dma);
    type.replaceChildren(...dmaKinds.map((k) => new Option(ATTENTION_NAMES[k] || k, k)));
    if (dmaKinds.includes(previous)) type.value = previous;
    drawDma();
  }
  $("tim-view").hidden = !data.tim;
  if (data.tim) { fillSelect($("tim-layer"), data.tim.map((l) => l.layer)); drawTim(); }
  $("rim-view").hidden = !data.rim;
  if (data.rim) { fillSelect($("rim-layer"), data.rim.map((l) => l.layer)); drawRim(); }
}

async function translate() {
  const text = $("source").value;
  $("error").hidden = true;
  $("status").textContent = "translating…";
  $("translate").disabled = true;
  try {
    const response = await fetch("/translate", {
      // attention: the views this page draws (the API leaves them out unless asked)
      method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify({ text, attention: true }),
    });
    const data = await response.json();
    if (!response.ok) throw new Error(data.error || `HTTP ${response.status}`);
    show(data);
    $("status").textContent = "";
  } catch (e) {
    $("status").textContent = "";
    $("error").textContent = e.message;
    $("error").hidden = false;
  } finally {
    $("translate").disabled = false;
  }
}

async function describeModel() {
  try {
    const info = await (await fetch("/info")).json();
    const t = info.text;
    $("model-info").textContent = `${info.model} (${info.family}, ${info.parameters.toLocaleString()} parameters), `
      + `${t.source_lang} → ${t.target_lang}, beam ${info.beam}; at most ${info.max_chars} characters `
      + `and ${info.max_source_tokens} subword tokens per request; input: ${t.steps} `
      + `(${t.settings === "recorded" ? "the data recipe's recorded settings" : "guessed: the data-bin records no settings"})`;
    $("source").maxLength = info.max_chars;
  } catch (e) {
    $("model-info").textContent = `cannot describe the model: ${e.message}`;
  }
}

$("translate").addEventListener("click", translate);
$("source").addEventListener("keydown", (e) => { if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) translate(); });
for (const id of ["attention-type", "attention-layer", "attention-head"]) $(id).addEventListener("change", drawAttention);
for (const id of ["dma-type", "dma-layer", "dma-head", "dma-side"]) $(id).addEventListener("change", drawDma);
$("tim-layer").addEventListener("change", drawTim);
$("rim-layer").addEventListener("change", drawRim);
describeModel();
