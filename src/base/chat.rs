//! The model's chat format: the Jinja chat template its files carry (GGUF
//! `tokenizer.chat_template`, an HF directory's `tokenizer_config.json`),
//! compiled once with minijinja and rendered as Hugging Face's
//! `apply_chat_template` renders it, so a prompt reads the way the model was
//! trained to read it.

use std::collections::BTreeMap;
use std::sync::Arc;

use minijinja::syntax::SyntaxConfig;
use minijinja::{Environment, ErrorKind, Value};

use super::error::{Error, Result};

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    pub role: String,
    pub content: String,
}

impl Message {
    pub fn new(role: &str, content: impl Into<String>) -> Message {
        Message {
            role: role.to_string(),
            content: content.into(),
        }
    }
}

/// The name the template is compiled under (minijinja's errors cite it with a line).
const TEMPLATE_NAME: &str = "chat_template";

/// A compiled chat template and the special tokens it may refer to.
#[derive(Clone)]
pub struct ChatTemplate {
    env: Arc<Environment<'static>>,
    /// Where the template came from (file and key), for errors.
    origin: String,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("origin", &self.origin)
            .finish()
    }
}

impl ChatTemplate {
    /// Compile `source`. `origin` says where it came from (e.g. `model.gguf
    /// (tokenizer.chat_template)`); the templates see `bos_token` and
    /// `eos_token` under those names, as HF's do, and nothing when absent.
    pub fn new(
        source: &str,
        origin: impl Into<String>,
        bos_token: Option<String>,
        eos_token: Option<String>,
    ) -> Result<ChatTemplate> {
        let origin = origin.into();
        let compile_error = |e: minijinja::Error| Error::BadChatTemplate {
            origin: origin.clone(),
            reason: e.to_string(),
        };
        let mut env = Environment::new();
        // transformers compiles chat templates with these two, and templates
        // are laid out (newlines after `{% ... %}`, indented tags) for them.
        let syntax = SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(compile_error)?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_template_owned(TEMPLATE_NAME, source.to_string())
            .map_err(compile_error)?;
        Ok(ChatTemplate {
            env: Arc::new(env),
            origin,
            bos_token,
            eos_token,
        })
    }

    /// The text the model reads for `messages`, ending where the assistant's
    /// reply begins (`add_generation_prompt`).
    pub fn render(&self, messages: &[Message]) -> Result<String> {
        let messages: Vec<Value> = messages
            .iter()
            .map(|m| {
                Value::from(BTreeMap::from([
                    ("role", Value::from(m.role.as_str())),
                    ("content", Value::from(m.content.as_str())),
                ]))
            })
            .collect();
        let mut context = BTreeMap::from([
            ("messages", Value::from(messages)),
            ("add_generation_prompt", Value::from(true)),
        ]);
        for (name, token) in [
            ("bos_token", &self.bos_token),
            ("eos_token", &self.eos_token),
        ] {
            if let Some(token) = token {
                context.insert(name, Value::from(token.as_str()));
            }
        }
        self.env
            .get_template(TEMPLATE_NAME)
            .and_then(|t| t.render(Value::from(context)))
            .map_err(|e| Error::ChatRender {
                origin: self.origin.clone(),
                reason: e.to_string(),
            })
    }
}

/// HF templates call `raise_exception(message)` to refuse a conversation
/// (e.g. roles that do not alternate); it fails the render with that message.
fn raise_exception(message: String) -> std::result::Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `chat_template` of meta-llama/Meta-Llama-3-8B-Instruct's
    /// `tokenizer_config.json`, verbatim (JSON escapes undone).
    const LLAMA_3: &str = "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}";

    /// `chat_template` of Qwen/Qwen2.5-0.5B-Instruct's `tokenizer_config.json`
    /// (the whole Qwen2.5-Instruct family's), verbatim (JSON escapes undone).
    const QWEN_2_5: &str = r#"{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"#;

    fn template(source: &str) -> ChatTemplate {
        ChatTemplate::new(source, "test", Some("<BOS>".into()), Some("<EOS>".into())).unwrap()
    }

    fn system_and_user() -> [Message; 2] {
        [
            Message::new("system", "Be brief."),
            Message::new("user", "  What is 2+2?\n"),
        ]
    }

    #[test]
    fn llama_3_renders_as_transformers_does() {
        let t = ChatTemplate::new(LLAMA_3, "test", Some("<|begin_of_text|>".into()), None).unwrap();
        assert_eq!(
            t.render(&system_and_user()).unwrap(),
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>\
             <|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|>\
             <|start_header_id|>assistant<|end_header_id|>\n\n"
        );
    }

    #[test]
    fn qwen_2_5_renders_as_transformers_does() {
        let t = template(QWEN_2_5);
        assert_eq!(
            t.render(&system_and_user()).unwrap(),
            "<|im_start|>system\nBe brief.<|im_end|>\n\
             <|im_start|>user\n  What is 2+2?\n<|im_end|>\n\
             <|im_start|>assistant\n"
        );
        // Without a system turn the template supplies Qwen's own.
        assert_eq!(
            t.render(&[Message::new("user", "hi")]).unwrap(),
            "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n\
             <|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn block_tags_take_their_line_with_them_as_in_transformers() {
        // trim_blocks drops the newline after a tag, lstrip_blocks the indent before it.
        let t = template("{% for m in messages %}\n  {% if m.content %}\n{{ m.content }}\n  {% endif %}\n{% endfor %}");
        assert_eq!(
            t.render(&system_and_user()).unwrap(),
            "Be brief.\n  What is 2+2?\n\n"
        );
    }

    #[test]
    fn templates_get_python_string_methods_and_the_special_tokens() {
        let t = template(
            "{{ bos_token }}{% for m in messages %}{% if m.content.strip().startswith('#') %}{{ m.content.strip().upper() }}{% else %}{{ m['content'].replace('a', 'o') }}{% endif %}|{% endfor %}{{ eos_token }}",
        );
        let messages = [
            Message::new("user", " # x "),
            Message::new("user", "banana"),
        ];
        assert_eq!(t.render(&messages).unwrap(), "<BOS># X|bonono|<EOS>");
    }

    #[test]
    fn a_template_that_fails_says_where_and_why() {
        let alternate = template(
            "{% for m in messages %}{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% endfor %}",
        );
        let e = alternate
            .render(&system_and_user())
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("test: rendering the chat template failed")
                && e.contains("Conversation roles must alternate"),
            "{e}"
        );
        let undefined = template("{{ messages[0].content.no_such_method() }}");
        let e = undefined
            .render(&system_and_user())
            .unwrap_err()
            .to_string();
        assert!(e.contains("no_such_method"), "{e}");
    }

    #[test]
    fn a_template_that_does_not_compile_is_a_clear_error() {
        let e = ChatTemplate::new("{% for m in messages %}{{ m }}", "m.gguf (key)", None, None)
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("m.gguf (key): the chat template does not compile")
                && e.contains("syntax error"),
            "{e}"
        );
    }
}
